"""How long the dashboard takes to render a snapshot with many requests in flight.

The snapshots are the real core's (`tests/gateway/busy_state.py`: a `Governor` that admitted the
requests and counted their tokens), served with the gateway's page by a tiny server; Debian's
headless chromium loads the page and is driven over the DevTools protocol
(`tests/gateway/browser.py`). Timed inside the page with `performance.now()`:

- render: one snapshot onto the page (ring sample, four charts, cards, sort, the visible rows),
  with the style and layout it causes (a forced layout before the clock stops). Every other
  render changes each request's KV blocks and token count, so the rows' cells really change.
- parse: `JSON.parse` of the `/api/state` body (what each poll adds before the render).
- sort click: a click on a column header (the page's handler: sort, repaint), with layout.

And the gateway's side of one poll, in this process: the core's snapshot with the state around
it (`state_of`, as `Gateway.state` builds it), and its encoding, as `/api/state` does it now
(`json.dumps`) and as FastAPI would for a returned dict (`jsonable_encoder`, then the same
dump). That time is taken from the gateway's event loop once a second per open page.

Usage: python -m benchmarks.dashboard_bench [--sizes 100 1000 5000] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi.encoders import jsonable_encoder
from tests.gateway.browser import Browser
from tests.gateway.busy_state import (
    StateServer,
    busy_core,
    busy_state,
    state_of,
)

_MEASURE = """(async () => {
  const text = await (await fetch('api/state')).text();
  const parse = [], paint = [], sort = [];
  for (let i = 0; i < REPEATS; i++) {
    let t = performance.now();
    const s = JSON.parse(text);
    parse.push(performance.now() - t);
    s.uptime_s = ring[ring.length - 1].t + 1;
    if (i % 2) for (const r of s.core.requests) { r.kv_blocks += 1; r.generated_tokens += 16; }
    t = performance.now();
    render(s);
    document.body.getBoundingClientRect();
    paint.push(performance.now() - t);
  }
  for (let i = 0; i < REPEATS; i++) {
    const th = document.querySelector(`th[data-key=${i % 2 ? 'id' : 'kv_blocks'}]`);
    const t = performance.now();
    th.click();
    document.body.getBoundingClientRect();
    sort.push(performance.now() - t);
  }
  return {parse, render: paint, sort, bytes: text.length,
          rows: document.querySelectorAll('#requests tr[data-id]').length};
})()"""


def measure(size: int, repeats: int, workdir: Path) -> dict[str, object]:
    """Render `repeats` snapshots of `size` requests in flight; times in ms."""
    state = busy_state(size)
    with StateServer(state) as server, Browser(workdir) as page:
        page.goto(f"{server.url}/dashboard")
        total = len(state["core"]["requests"])
        page.wait_for(f"document.getElementById('count').textContent === '({total:,})'")
        result: dict[str, object] = page.evaluate(_MEASURE.replace("REPEATS", str(repeats)))
    result.update(in_flight=state["core"]["running"], requests=total)
    return result


def gateway_cost(size: int, repeats: int) -> dict[str, list[float]]:
    """Milliseconds of one `/api/state` in the gateway: the state, and two ways to encode it."""
    governor, now = busy_core(size)
    state = state_of(governor, now)

    def timed(step: Any) -> list[float]:
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            samples.append((time.perf_counter() - start) * 1e3)
        return samples

    def dumps(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    return {
        "state": timed(lambda: state_of(governor, now)),
        "dumps": timed(lambda: dumps(state)),
        "encoder": timed(lambda: dumps(jsonable_encoder(state))),
    }


def _cell(samples: list[float]) -> str:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered):.1f} / {p95:.1f} / {ordered[-1]:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 5000])
    parser.add_argument("--repeats", type=int, default=30, help="renders (and clicks) per size")
    parser.add_argument("--json", type=Path, help="also write the raw timings here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            results.append(measure(size, args.repeats, Path(tmp) / str(size)))
    print(
        "| in flight (+ queued) | /api/state bytes | rows in the DOM | parse ms | render ms | "
        "sort click ms |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['in_flight']:,} (+{int(r['requests']) - int(r['in_flight'])}) "  # type: ignore[call-overload]
            f"| {r['bytes']:,} | {r['rows']} | {_cell(r['parse'])} | {_cell(r['render'])} "  # type: ignore[arg-type]
            f"| {_cell(r['sort'])} |"  # type: ignore[arg-type]
        )
    print("(median / p95 / max)\n")
    costs = {size: gateway_cost(size, args.repeats) for size in args.sizes}
    print("| in flight | state ms | json.dumps ms (now) | jsonable_encoder + dumps ms (before) |")
    print("|---|---:|---:|---:|")
    for size, c in costs.items():
        print(f"| {size:,} | {_cell(c['state'])} | {_cell(c['dumps'])} | {_cell(c['encoder'])} |")
    print("(median / p95 / max)")
    for r, size in zip(results, args.sizes, strict=True):
        r["gateway"] = costs[size]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
