#!/usr/bin/env bash
# Run a built llmflow image as the chart runs it, where no container runtime can start one
# (this project's machines: buildah builds, but crun cannot create containers here).
#
#   deploy/container/smoke.sh [IMAGE]      # default localhost/llmflow:0.1.0; needs root
#
# buildah mounts the image's root filesystem; the script remounts it read-only, gives it a
# tmpfs at /tmp and /run/llmflow (the chart's emptyDirs), and runs the chart's two steps
# chrooted as uid 10001 with the image's own environment, in a network namespace of its own
# (loopback only): the init step (the rendered assemble_config.py on the rendered ConfigMap
# and Secret) and the image's entrypoint with the chart's args, in front of `llmflow simserve`.
# It then checks from outside with curl: /healthz, /readyz, a chat completion with a tenant's
# key (and 401 without), /metrics on the admin port with the admin key (and 401 without), the
# image's HEALTHCHECK command, the otel extra, that SIGTERM ends the gateway with status 0, and
# what it wrote under /tmp.
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE=${1:-localhost/llmflow:0.1.0}
B=(buildah --storage-driver vfs)
PY=${PYTHON:-.venv/bin/python}

ctr=$("${B[@]}" from "$IMAGE")
work=$(mktemp -d)
trap '"${B[@]}" umount "$ctr" >/dev/null; "${B[@]}" rm "$ctr" >/dev/null; rm -rf "$work"' EXIT
root=$("${B[@]}" mount "$ctr")
"${B[@]}" inspect --type image "$IMAGE" | "$PY" -c "import json, sys; print(json.dumps(json.load(sys.stdin)[\"Docker\"][\"config\"]))" > "$work/image.json"

# The chart rendered for a backend on this namespace's loopback, as files the pod would see.
"$PY" - "$work" <<'EOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "tests")
from deploy.chart import render
work = Path(sys.argv[1])
r = render({
    "config": {
        "backends": [{"name": "sim", "url": "http://127.0.0.1:8000", "models": ["sim"]}],
        "tenants": [{"name": "acme", "tier": "vip"}],
        "metrics": {"scrape_interval_ms": 200},
    },
    "secrets": {"tenantApiKeys": {"acme": ["sk-acme-smoke"]}},
})
for sub, data in (("chart", r.configmap), ("secrets", r.secret)):
    (work / sub).mkdir()
    for key, text in data.items():
        (work / sub / key).write_text(text)
gw = r.gateway["spec"]["template"]["spec"]
(work / "pod.json").write_text(json.dumps(gw))
image = json.loads((work / "image.json").read_text())
(work / "env").write_text("\n".join(image["Env"]) + "\n")
init = next(c for c in gw["initContainers"] if c["name"] == "config")
main = next(c for c in gw["containers"] if c["name"] == "llmflow")
(work / "init.cmd").write_text("\0".join(init["command"]))
(work / "main.cmd").write_text("\0".join(image["Entrypoint"] + main["args"]))
(work / "health.cmd").write_text("\0".join(image["Healthcheck"]["Test"][1:]))  # after CMD
print("admin key:", len(r.secret["admin-api-key"]), "characters")
EOF
chmod -R a+rX "$work"
mkdir -p "$root/etc/llmflow/chart" "$root/etc/llmflow/secrets" "$root/run/llmflow"

# shellcheck disable=SC2016  # the inner shell expands them, inside the namespaces
unshare --mount --net --fork env ROOT="$root" WORK="$work" PY="$PY" bash -euo pipefail -c '
ip link set lo up
mount --bind "$ROOT" "$ROOT" && mount -o remount,bind,ro "$ROOT"  # readOnlyRootFilesystem
ro_bind() { mount --bind "$1" "$2" && mount -o remount,bind,ro "$2"; }
ro_bind "$WORK/chart" "$ROOT/etc/llmflow/chart"      # the ConfigMap volume
ro_bind "$WORK/secrets" "$ROOT/etc/llmflow/secrets"  # the Secret volume
mount --rbind /dev "$ROOT/dev"
mount -t proc proc "$ROOT/proc"
mount -t tmpfs -o mode=1777 tmpfs "$ROOT/tmp"  # the emptyDirs
mount -t tmpfs -o mode=0700,uid=10001,gid=10001 tmpfs "$ROOT/run/llmflow"
in_image() {  # run a command in the image as its user, with its environment only
  mapfile -t env < "$WORK/env"
  exec chroot --userspec=10001:10001 "$ROOT" /usr/bin/env -i "${env[@]}" "$@"  # one pid
}
if touch "$ROOT/probe" 2>/dev/null; then echo "root is writable"; exit 1; fi
"$PY" -m llmflow.cli simserve --port 8000 --model-name sim --speed 20 > "$WORK/simserve.log" 2>&1 &
sim=$!
gw=
cleanup() { kill $gw $sim 2>/dev/null || true; }
trap cleanup EXIT  # a failed check leaves nothing running
mapfile -d "" -t init < "$WORK/init.cmd"; mapfile -d "" -t main < "$WORK/main.cmd"
echo "== init step: ${init[*]}"
( in_image "${init[@]}" )
echo "== gateway: ${main[*]}"
in_image "${main[@]}" > "$WORK/gateway.log" 2>&1 &
gw=$!
for _ in $(seq 1 150); do curl -sf localhost:8080/readyz >/dev/null && break; sleep 0.2; done
key=$(cat "$WORK/secrets/admin-api-key")
check() { printf "%-52s %s\n" "$1" "$2"; [ "$2" = "$3" ] || { tail -30 "$WORK/gateway.log"; exit 1; }; }
mapfile -d "" -t health < "$WORK/health.cmd"
hc=0; ( in_image "${health[@]}" ) || hc=$?
check "HEALTHCHECK, the image command" "$hc" 0
ot=0; ( in_image python -c "import opentelemetry.exporter.otlp.proto.http.trace_exporter" ) || ot=$?
check "the otel extra imports (telemetry: works)" "$ot" 0
check "GET /healthz" "$(curl -s -o /dev/null -w %{http_code} localhost:8080/healthz)" 200
check "GET /readyz" "$(curl -s -o /dev/null -w %{http_code} localhost:8080/readyz)" 200
body={\"model\":\"sim\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}
chat() { curl -s -o "$WORK/reply.json" -w %{http_code} localhost:8080/v1/chat/completions \
  -H "Content-Type: application/json" "$@" -d "$body"; }
check "POST /v1/chat/completions, tenant key" "$(chat -H "Authorization: Bearer sk-acme-smoke")" 200
check "POST /v1/chat/completions, no key" "$(chat)" 401
check "GET :9090/metrics, admin key" \
  "$(curl -s -o "$WORK/metrics.txt" -w %{http_code} -H "Authorization: Bearer $key" localhost:9090/metrics)" 200
check "GET :9090/metrics, no key" "$(curl -s -o /dev/null -w %{http_code} localhost:9090/metrics)" 401
check "GET :8080/metrics (admin routes off the API port)" \
  "$(curl -s -o /dev/null -w %{http_code} -H "Authorization: Bearer $key" localhost:8080/metrics)" 404
grep -m1 "^llmflow_requests_total" "$WORK/metrics.txt"
kill -TERM "$gw"; status=0; wait "$gw" || status=$?
check "exit status after SIGTERM" "$status" 0
echo "written under /tmp: $(find "$ROOT/tmp" -mindepth 1 | sed "s|$ROOT||" | tr "\n" " ")"
kill "$sim"; wait "$sim" 2>/dev/null || true
'
echo "smoke: ok"
