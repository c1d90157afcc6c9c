"""The lifecycle lives once, in the core's runtime: the hosts' Python must not grow it back.

The gateway and the simulator feed events to `llmflow._core.Runtime` and carry out its actions.
Timers, deadlines, the stall rule, backend health, Retry-After, dispatch and the replicas' slot
leases (caps, when to ask, a refusal, a lost store, release, which leases a sync renews) are
the runtime's.
This test reads the hosts' sources and fails on the usual suspects; each exception is listed
with the reason it is not lifecycle.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "llmflow"
HOSTS = [
    *sorted((PACKAGE / "gateway").rglob("*.py")),
    PACKAGE / "sim" / "policies.py",
    PACKAGE / "sim" / "replicas.py",
    PACKAGE / "store.py",
]

SUSPECTS = {
    "a timer of its own": (
        r"\bcall_later\b|\bcall_at\b|\bwait_for\(|\bmove_on_after\(|\bfail_after\("
    ),
    "a simulated timer": r"\benv\.timeout\(",
    "a deadline or stall setting": (
        r"\.stall_timeout_ms|\.first_token_timeout_ms|\.total_ms|\.max_wait_ms|stall_timeout_s"
    ),
    "Retry-After arithmetic": r"(?i)retry.*\bceil\(|retry_after_s\s*[-+*/]|retry-after.*\bmax\(",
    "health bookkeeping": r"FAILURES_BEFORE|ever_scraped|down_at|mark_down|\.healthy\s*=\s*False",
    "the governor's lifecycle calls": (
        r"\.expire\(|next_deadline_us|\.dispatch\(|set_backend_health|observe_backend"
        r"|\bGovernor\("
    ),
    "a stall watcher": r"StallWatch|stalled_for|busy_since",
    "lease arithmetic": (
        r"\bgpus\s*\*|\bper_gpu\b|\bcap\s*//|//\s*[\w.]*replicas\b|\b(count|live)\s*-\s*"
        r"|len\(self\.held"
    ),
    "a lease decision": r"\bon_loss\s*[!=]=|\bgranted\s+or\b|\blost\s+and\b|\.held\[",
}

# (file, suspect) pairs that are not lifecycle, each with why.
ALLOWED = {
    # The host's ONE timer is the runtime's `Arm` action carried out.
    ("gateway/host.py", "a timer of its own"),
    # The simulator's `Arm` is a SimPy timeout, as is its scrape period (vLLM's metrics
    # interval, an input to the runtime, not a lifecycle rule).
    ("sim/policies.py", "a simulated timer"),
    # Upstream I/O: how long a connect or the body's last bytes may take, not a request rule.
    ("gateway/upstream.py", "a timer of its own"),
    ("gateway/http1.py", "a timer of its own"),
    # Connection I/O: after an error answer, how long the rest of a refused upload is read and
    # dropped before the socket closes (so the client reads the answer, not a reset); and how
    # long a client may take to send a request at all (slowloris), below any request.
    ("gateway/guard.py", "a timer of its own"),
    # Connection I/O: how long a WebSocket with no request live may stay silent before it is
    # closed (`server.ws_idle_timeout_ms`), below any request, as guard's read timeout.
    ("gateway/ws.py", "a timer of its own"),
    # The native front's records reach the metrics and the access log at this tick at the
    # latest: counting, not a request rule.
    ("gateway/native.py", "a timer of its own"),
    # The embedded simulated backend is a backend, not the gateway's lifecycle.
    ("gateway/embedded.py", "a timer of its own"),
    # The simulated Redis's round trip and the sync period are I/O timing (inputs to the
    # runtime, as the scrape period is), not a lease rule.
    ("sim/replicas.py", "a simulated timer"),
}


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Source lines without comments and docstrings (the rules may be named in prose)."""
    text = path.read_text(encoding="utf-8")
    text = re.sub(r'"""(?:.|\n)*?"""', lambda m: "\n" * m.group(0).count("\n"), text)
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        if code.strip():
            lines.append((number, code))
    return lines


@pytest.mark.parametrize("path", HOSTS, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_hosts_hold_no_lifecycle(path: Path) -> None:
    name = str(path.relative_to(PACKAGE))
    found = [
        f"{name}:{number}: {what}: {code.strip()}"
        for number, code in _code_lines(path)
        for what, pattern in SUSPECTS.items()
        if (name, what) not in ALLOWED and re.search(pattern, code)
    ]
    assert not found, "lifecycle logic belongs in rust/src/runtime/:\n" + "\n".join(found)


def test_the_check_can_fail(tmp_path: Path) -> None:
    """The patterns catch the code that used to live here."""
    old = [
        "self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)",
        'return {"Retry-After": str(max(1, math.ceil(seconds)))}',
        "enough = state.failures >= FAILURES_BEFORE_UNHEALTHY or not state.ever_scraped",
        "for expired in self.governor.expire(now_us()):",
        "ev = self.env.timeout(self.settings.backpressure.stall_timeout_ms / 1000.0)",
        "self.caps = {b.name: b.gpus * per_gpu for b in settings.backends}",
        "elsewhere = cap - max(cap // self.state.replicas, 1)",
        'if granted or (self.lost and self.state.on_loss == "local_share"):',
        'if self.state.on_loss == "fail_closed":',
        "elsewhere_n = max(count - len(self.held[backend]), 0)",
        "mine_n = sum(1 for b, _ in self.held[k].values() if b == backend)",
    ]
    for line in old:
        assert any(re.search(p, line) for p in SUSPECTS.values()), line


# ---- the Rust hosts: the native front and the relay carry out actions, the tally counts them;
# they decide nothing ----

RUST = PACKAGE.parent.parent / "rust" / "src"
RUST_HOSTS = sorted(
    p
    for p in [
        *(RUST / "front").rglob("*.rs"),
        *(RUST / "relay").rglob("*.rs"),
        RUST / "hosted.rs",
        RUST / "tally.rs",  # the per-request counts and the access log: it counts, decides nothing
    ]
    if p.name != "tests.rs"
)

RUST_SUSPECTS = {
    "a timer of its own": r"\btokio::time::(sleep|sleep_until|interval|timeout)\b|\brecv_timeout\(",
    "a deadline or stall setting": (
        r"stall_timeout|first_token_timeout|total_ms|max_wait_ms|queue_timeout"
    ),
    "Retry-After arithmetic": (
        r"retry_after\w*\s*[-+*/]|retry_after\w*\.(max|min|div)|retry_after\w*\s*=.*\.(ceil|max|min)\("
    ),
    "the governor's decisions": (
        r"\.(submit|dispatch|expire|finish|refusal|next_deadline_us)\(|Governor::new"
    ),
    "health or lease bookkeeping": r"\b(healthy|set_health|leases?_held|on_loss)\b\s*[=(]",
}

# (file, suspect) pairs that are not lifecycle, each with why.
RUST_ALLOWED = {
    # The runtime's ONE timer: its `Arm` action carried out on tokio.
    ("front/owner.rs", "a timer of its own"),
    # A whole reply's write timeout (server.write_timeout_ms), and the wait for aborts to
    # reach their sockets before a `Start` goes upstream: I/O pacing, not a request rule.
    ("front/governed.rs", "a timer of its own"),
    # An `Ack`'s bound wait: a `Start` waits at most ABORT_WAIT for the aborts before it to
    # reach their sockets (ordering of I/O between the hosts, no request's rule).
    ("hosted.rs", "a timer of its own"),
    # Connection I/O: how long a client may take to send a request at all (slowloris), how
    # long a connection idles between requests, and a back-off when descriptors run out.
    ("front/conn.rs", "a timer of its own"),
    ("front/mod.rs", "a timer of its own"),
    # Connection I/O: a client that takes none of a passed reply for server.write_timeout_ms.
    ("front/from_app.rs", "a timer of its own"),
    # Upstream I/O: the connect timeout, the coalescing interval, the token batch, how long
    # vLLM's body may take to end after [DONE], the host's wait for a control to be carried out.
    ("relay/mod.rs", "a timer of its own"),
    ("relay/upstream.rs", "a timer of its own"),
    ("relay/stream/mod.rs", "a timer of its own"),
    # jiter's `Jiter::finish`: the JSON parser's check that only whitespace follows the body's
    # value (`decode_json`'s "trailing characters"), no request's end.
    ("front/decode.rs", "the governor's decisions"),
}


def _rust_code_lines(path: Path) -> list[tuple[int, str]]:
    """Source lines without comments (`//`, `///`, `//!`) and without the test module."""
    text = path.read_text(encoding="utf-8")
    text = text.split("#[cfg(test)]", 1)[0]
    # String literals go first (a reason's name in a message is no rule), then comments.
    text = re.sub(r'"(?:[^"\\\n]|\\.)*"', '""', text)
    return [
        (number, code)
        for number, line in enumerate(text.splitlines(), 1)
        if (code := line.split("//", 1)[0]).strip()
    ]


@pytest.mark.parametrize("path", RUST_HOSTS, ids=lambda p: str(p.relative_to(RUST)))
def test_the_rust_hosts_hold_no_lifecycle(path: Path) -> None:
    name = str(path.relative_to(RUST))
    found = [
        f"{name}:{number}: {what}: {code.strip()}"
        for number, code in _rust_code_lines(path)
        for what, pattern in RUST_SUSPECTS.items()
        if (name, what) not in RUST_ALLOWED and re.search(pattern, code)
    ]
    assert not found, "lifecycle logic belongs in rust/src/runtime/:\n" + "\n".join(found)


def test_the_rust_check_can_fail() -> None:
    """The patterns catch what a host deciding for itself would write."""
    deciding = [
        "let deadline = tokio::time::sleep(Duration::from_millis(first_token_timeout_ms));",
        "let retry_after_s = (wait_s / drain).ceil() as u64 + 1;",
        "let wait = retry_after_s * 2;",
        "if let Decision::Admitted(_) = gov.submit(arrival, now) {",
        "for expired in gov.expire(now) {",
        "set_health(backend, false);",
        "let stall = Instant::now() + config.stall_timeout;",
    ]
    for line in deciding:
        assert any(re.search(p, line) for p in RUST_SUSPECTS.values()), line
