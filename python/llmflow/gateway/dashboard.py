"""The live KV-occupancy dashboard: one self-contained HTML page polling `/api/state`.

No external scripts or styles (the gateway may run with no internet): per backend, the KV cache
usage vLLM reports beside the blocks the core's ledger holds; the queue by tier; and every live
request with its KV footprint, largest first, so a long report hogging the cache stands out.
"""

from __future__ import annotations

__all__ = ["PAGE"]

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>llmflow: KV occupancy</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .3em}h2{font-size:1.05em;margin:1.2em 0 .4em}
.row{display:flex;flex-wrap:wrap;gap:1em}.card{background:#fff;border:1px solid #ddd;
border-radius:6px;padding:.8em 1em;min-width:16em}.bar{background:#eee;height:12px;
border-radius:3px;overflow:hidden;margin:.2em 0 .5em}.fill{height:100%;background:#3b82f6}
.hot{background:#ef4444}.warn{background:#f59e0b}table{border-collapse:collapse;width:100%;
background:#fff}td,th{border-bottom:1px solid #eee;padding:.3em .5em;text-align:left}
.muted{color:#888}.bad{color:#b91c1c;font-weight:600}.ok{color:#15803d}
</style></head><body>
<h1>llmflow gateway: KV occupancy</h1>
<div id="status" class="muted">connecting...</div>
<h2>Backends</h2><div id="backends" class="row"></div>
<h2>Queue by tier</h2><div id="queue" class="row"></div>
<h2>Live requests (largest KV first)</h2>
<table><thead><tr><th>id</th><th>tenant</th><th>tier</th><th>backend</th><th>state</th>
<th>tokens</th><th>KV blocks</th><th>block-s</th><th>age s</th></tr></thead>
<tbody id="requests"></tbody></table>
<script>
const esc = s => String(s ?? "").replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",
  '"':"&quot;"}[c]));
const bar = f => { const p = Math.max(0, Math.min(1, f || 0)) * 100;
  const cls = p >= 85 ? "fill hot" : p >= 70 ? "fill warn" : "fill";
  return `<div class="bar"><div class="${cls}" style="width:${p.toFixed(1)}%"></div></div>`; };
function render(s) {
  const core = s.core || {};
  document.getElementById("status").innerHTML =
    `${s.draining ? '<span class="bad">DRAINING</span> ' : ''}running ${core.running ?? 0}` +
    ` &middot; queued ${core.queued ?? 0} &middot; KV blocks ${core.kv_blocks_in_use ?? 0}` +
    ` &middot; shed level ${core.shed_level ?? 0} &middot; up ${s.uptime_s}s`;
  const ledger = Object.fromEntries((core.backends || []).map(b => [b.name, b]));
  document.getElementById("backends").innerHTML = Object.entries(s.backends || {}).map(
    ([name, b]) => { const l = ledger[name] || {}; const cap = l.kv_capacity_blocks || 0;
      const held = l.kv_blocks_reserved || 0;
      return `<div class="card"><b>${esc(name)}</b> <span class="${b.healthy ? "ok" : "bad"}">` +
        `${b.healthy ? "healthy" : "unhealthy"}</span><div class="muted">${esc(b.url)}</div>` +
        `vLLM KV usage ${b.kv_usage == null ? "?" : (100 * b.kv_usage).toFixed(1) + "%"}` +
        bar(b.kv_usage) + `ledger ${held}${cap ? " / " + cap : ""} blocks` +
        bar(cap ? held / cap : 0) + `running ${b.running ?? "?"} (cap ${l.cap ?? "?"}),` +
        ` waiting ${b.waiting ?? "?"}, preemptions ${b.preemptions_total ?? "?"}</div>`; }
  ).join("");
  document.getElementById("queue").innerHTML = Object.entries(core.queued_by_tier || {}).map(
    ([tier, n]) => `<div class="card"><b>${esc(tier)}</b>: ${n}</div>`).join("");
  const reqs = (core.requests || []).slice().sort((a, b) => b.kv_blocks - a.kv_blocks);
  document.getElementById("requests").innerHTML = reqs.map(r => `<tr><td>${r.id}</td>` +
    `<td>${esc(r.tenant)}</td><td>${esc(r.tier)}</td><td>${esc(r.backend)}</td>` +
    `<td>${esc(r.state)}</td><td>${r.generated_tokens ?? ""}</td><td>${r.kv_blocks}</td>` +
    `<td>${(r.kv_block_seconds ?? 0).toFixed(1)}</td><td>${(r.age_s ?? 0).toFixed(1)}</td>` +
    `</tr>`).join("");
}
async function poll() {
  try { const r = await fetch("api/state"); render(await r.json()); }
  catch (e) { document.getElementById("status").textContent = "gateway unreachable: " + e; }
  setTimeout(poll, 500);
}
poll();
</script></body></html>
"""
