"""The live dashboard: one self-contained HTML page polling `/api/state` once a second.

No external scripts or styles (the gateway may run with no internet): the script
(`dashboard.js`, beside this file) is inlined into the page. It shows ten minutes of charts
drawn as plain SVG (KV usage per backend, queue and in flight per tier, refusals by reason,
TTFT p50/p99), per backend the KV cache usage vLLM reports beside the blocks the core's ledger
holds, the queue by tier, and every live request with its KV footprint and vLLM priority,
sortable by any column.

The ten minutes of history live in the browser, not in the gateway: each poll adds one sample
to the page's own ring, so the gateway keeps no state and runs no timer for the dashboard, and a
closed page costs nothing. A page opened now starts its charts now.
"""

from __future__ import annotations

from importlib.resources import files

__all__ = ["PAGE"]

_SHELL = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>llmflow: live state</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .3em}h2{font-size:1.05em;margin:1.2em 0 .4em}
.row{display:flex;flex-wrap:wrap;gap:1em}.card{background:#fff;border:1px solid #ddd;
border-radius:6px;padding:.8em 1em;min-width:16em}.bar{background:#eee;height:12px;
border-radius:3px;overflow:hidden;margin:.2em 0 .5em}.fill{height:100%;background:#3b82f6}
.hot{background:#ef4444}.warn{background:#f59e0b}
.muted{color:#888}.bad{color:#b91c1c;font-weight:600}.ok{color:#15803d}
.chart{background:#fff;border:1px solid #ddd;border-radius:6px;padding:.5em .8em;margin:0}
.chart figcaption{font-weight:600;margin-bottom:.2em}.chart svg{display:block}
.chart text{font:10px system-ui,sans-serif;fill:#888}.grid{stroke:#eee}
.legend{font-size:12px;max-width:440px}.legend span{margin-right:.9em;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:3px;margin-right:3px;vertical-align:middle}
#scroller{max-height:60vh;overflow:auto;background:#fff;border:1px solid #ddd}
table{border-collapse:collapse;width:100%;table-layout:fixed}
td,th{border-bottom:1px solid #eee;padding:0 .5em;text-align:left;height:23px;
white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
th{position:sticky;top:0;background:#f3f4f6;cursor:pointer;user-select:none;z-index:1}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
td.num,th.num{text-align:right}tr.pad td{padding:0;border:0;height:auto}
</style></head><body>
<h1>llmflow gateway</h1>
<div id="status" class="muted">connecting...</div>
<h2>Last 10 minutes</h2>
<div id="charts" class="row"></div>
<h2>Backends</h2><div id="backends" class="row"></div>
<h2>Queue by tier</h2><div id="queue" class="row"></div>
<h2>Live requests <span id="count" class="muted"></span></h2>
<div id="scroller"><table><thead><tr id="columns"></tr></thead>
<tbody id="requests"></tbody></table></div>
<script>
/*SCRIPT*/
</script></body></html>
"""

PAGE = _SHELL.replace(
    "/*SCRIPT*/", files("llmflow.gateway").joinpath("dashboard.js").read_text(encoding="utf-8")
)
