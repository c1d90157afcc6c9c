"use strict";
// The dashboard's script, inlined into the page by dashboard.py. It polls api/state once a
// second, keeps the last ten minutes of samples itself (the gateway keeps no history for it),
// draws the charts as plain SVG, and renders only the rows of the request table that are in
// view, reusing their DOM nodes, so a thousand requests in flight cost a screenful of rows.

const POLL_MS = 1000;
const WINDOW_S = 600;          // the charts' span
const MAX_SAMPLES = 720;       // a bound on the ring whatever the poll rate does
const RATE_WINDOW_S = 10;      // refusals per second over the trailing 10 s
const TTFT_WINDOW_S = 60;      // TTFT quantiles over the trailing minute
const GAP_S = 5;               // a longer pause between samples (a hidden tab) breaks the line
const OVERSCAN = 10;           // rows rendered above and below the visible ones
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2",
  "#db2777", "#65a30d", "#475569", "#ea580c"];

const $ = id => document.getElementById(id);
const esc = s => String(s ?? "").replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;",
  ">": "&gt;", '"': "&quot;"}[c]));

// ---- the ring of samples: one per poll, ten minutes ----

const ring = [];

function addSample(s) {
  const core = s.core || {};
  const t = s.uptime_s;
  const last = ring[ring.length - 1];
  if (last && t < last.t) ring.length = 0;  // the gateway restarted, and its counters with it
  else if (last && t === last.t) return;
  const kv = {};
  for (const b of core.backends || []) kv[b.name] = 100 * (b.kv_usage || 0);
  const queued = {...(core.queued_by_tier || {})};
  const running = Object.fromEntries(Object.keys(queued).map(tier => [tier, 0]));
  for (const r of core.requests || []) {
    if (r.state !== "queued") running[r.tier] = (running[r.tier] || 0) + 1;
  }
  const refused = {};
  for (const o of s.outcomes || []) {
    if (o.outcome === "rejected") refused[o.reason] = (refused[o.reason] || 0) + o.count;
  }
  let ttft = null;
  if (s.ttft) {  // cumulative bucket counts, summed over tiers
    ttft = new Array(s.ttft.bounds.length + 1).fill(0);
    for (const counts of Object.values(s.ttft.by_tier)) counts.forEach((c, i) => ttft[i] += c);
  }
  ring.push({t, kv, queued, running, refused, ttft, bounds: s.ttft ? s.ttft.bounds : []});
  while (ring.length > MAX_SAMPLES || ring[0].t < t - WINDOW_S) ring.shift();
}

function keysOf(field) {
  const keys = new Set();
  for (const p of ring) for (const k of Object.keys(p[field])) keys.add(k);
  return [...keys].sort();
}

// The index of the oldest sample within `span` seconds before sample i (never i itself).
function windowStart(i, span) {
  let j = i;
  while (j > 0 && ring[j - 1].t >= ring[i].t - span) j--;
  return j === i ? i - 1 : j;
}

// Prometheus' histogram_quantile: linear inside the bucket that holds the rank.
function quantile(q, cumulative, bounds) {
  const total = cumulative[cumulative.length - 1];
  if (!(total > 0)) return null;
  const rank = q * total;
  let b = 0;
  while (cumulative[b] < rank) b++;
  if (b >= bounds.length) return bounds[bounds.length - 1];
  const lo = b ? bounds[b - 1] : 0, below = b ? cumulative[b - 1] : 0;
  return lo + (bounds[b] - lo) * (rank - below) / (cumulative[b] - below);
}

// A line keeps its colour while the page lives, whatever names come and go beside it.
const colours = new Map();
function colour(kind, name) {
  const key = `${kind}\u0000${name}`;
  if (!colours.has(key)) {
    const taken = [...colours.keys()].filter(k => k.startsWith(`${kind}\u0000`)).length;
    colours.set(key, PALETTE[taken % PALETTE.length]);
  }
  return colours.get(key);
}

function kvSeries() {
  return keysOf("kv").map(name => ({name, color: colour("kv", name),
    points: ring.map(p => [p.t, p.kv[name] ?? null])}));
}

function tierSeries() {
  return keysOf("queued").flatMap(tier => {
    const color = colour("tier", tier);
    return [
      {name: `${tier} in flight`, color, points: ring.map(p => [p.t, p.running[tier] ?? 0])},
      {name: `${tier} queued`, color, dash: "4 3", points: ring.map(p => [p.t, p.queued[tier] ?? 0])},
    ];
  });
}

function refusalSeries() {
  return keysOf("refused").map(reason => ({name: reason, color: colour("refusal", reason),
    points: ring.map((p, i) => {
      const j = windowStart(i, RATE_WINDOW_S);
      if (j < 0) return [p.t, null];
      const q = ring[j];
      return [p.t, ((p.refused[reason] || 0) - (q.refused[reason] || 0)) / (p.t - q.t)];
    })}));
}

function ttftSeries() {
  return [[0.5, "p50", PALETTE[0]], [0.99, "p99", PALETTE[1]]].map(([q, name, color]) => ({
    name, color, points: ring.map((p, i) => {
      const j = windowStart(i, TTFT_WINDOW_S);
      if (j < 0 || !p.ttft || !ring[j].ttft) return [p.t, null];
      const delta = p.ttft.map((c, k) => c - ring[j].ttft[k]);
      return [p.t, quantile(q, delta, p.bounds)];
    })}));
}

// ---- charts: plain SVG, one <path> per series, kept and updated in place ----

const SVG = "http://www.w3.org/2000/svg";
const W = 440, H = 150, LEFT = 46, RIGHT = 8, TOP = 8, BOTTOM = 18;

function svgEl(tag, attrs, parent) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map(m => m * p).find(m => m >= v);
}

class Chart {
  constructor(id, title, format, fixedMax) {
    this.format = format;
    this.fixedMax = fixedMax;
    const fig = document.createElement("figure");
    fig.className = "chart";
    fig.id = id;
    fig.innerHTML = `<figcaption>${esc(title)}</figcaption>`;
    this.svg = svgEl("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`}, fig);
    this.yLabels = [0, 0.5, 1].map(f => {
      const y = TOP + (1 - f) * (H - TOP - BOTTOM);
      svgEl("line", {x1: LEFT, x2: W - RIGHT, y1: y, y2: y, class: "grid"}, this.svg);
      return svgEl("text", {x: LEFT - 4, y: y + 3, "text-anchor": "end"}, this.svg);
    });
    [["-10 min", LEFT, "start"], ["-5 min", (LEFT + W - RIGHT) / 2, "middle"],
      ["now", W - RIGHT, "end"]].forEach(([label, x, anchor]) => {
      svgEl("text", {x, y: H - 4, "text-anchor": anchor}, this.svg).textContent = label;
    });
    this.lines = svgEl("g", {fill: "none", "stroke-width": 1.5}, this.svg);
    this.paths = new Map();
    this.legend = document.createElement("div");
    this.legend.className = "legend";
    fig.appendChild(this.legend);
    $("charts").appendChild(fig);
  }

  draw(series, now) {
    let top = 0;
    for (const s of series) for (const [, v] of s.points) if (v != null && v > top) top = v;
    const max = this.fixedMax || niceMax(top);
    this.yLabels.forEach((label, i) => { label.textContent = this.format(max * i / 2); });
    const x = t => LEFT + (t - (now - WINDOW_S)) / WINDOW_S * (W - LEFT - RIGHT);
    const y = v => TOP + (1 - Math.min(v, max) / max) * (H - TOP - BOTTOM);
    const seen = new Set();
    const legend = [];
    for (const s of series) {
      seen.add(s.name);
      let path = this.paths.get(s.name);
      if (!path) {
        path = svgEl("path", {stroke: s.color, "data-series": s.name}, this.lines);
        if (s.dash) path.setAttribute("stroke-dasharray", s.dash);
        this.paths.set(s.name, path);
      }
      let d = "", count = 0, prev = null, latest = null;
      for (const [t, v] of s.points) {
        if (v == null) { prev = null; continue; }
        const move = prev == null || t - prev > GAP_S;
        d += `${move ? "M" : "L"}${x(t).toFixed(1)} ${y(v).toFixed(1)}`;
        prev = t;
        latest = v;
        count++;
      }
      path.setAttribute("d", d);
      path.dataset.points = count;
      legend.push(`<span><i style="background:${s.color}"></i>${esc(s.name)} ` +
        `${latest == null ? "-" : esc(this.format(latest))}</span>`);
    }
    for (const [name, path] of this.paths) {
      if (!seen.has(name)) { path.remove(); this.paths.delete(name); }
    }
    this.legend.innerHTML = legend.join("") || '<span class="muted">no data yet</span>';
  }
}

const trim = v => String(Number(v.toPrecision(3)));
const charts = [
  [new Chart("chart-kv", "KV usage per backend (%)", v => `${trim(v)}%`, 100), kvSeries],
  [new Chart("chart-tiers", "In flight (solid) and queued (dashed) per tier", trim), tierSeries],
  [new Chart("chart-refusals", `Refusals by reason (/s, last ${RATE_WINDOW_S} s)`,
    v => `${trim(v)}/s`), refusalSeries],
  [new Chart("chart-ttft", `TTFT p50 and p99 (last ${TTFT_WINDOW_S} s)`,
    v => v < 1 ? `${trim(v * 1000)} ms` : `${trim(v)} s`), ttftSeries],
];

function drawCharts() {
  const now = ring.length ? ring[ring.length - 1].t : 0;
  for (const [chart, series] of charts) chart.draw(series(), now);
}

// ---- the request table: sortable, only the rows in view, DOM nodes reused ----

const COLUMNS = [
  {key: "id", label: "id", num: true},
  {key: "tenant", label: "tenant"},
  {key: "tier", label: "tier"},
  {key: "model", label: "model", optional: true},
  {key: "backend", label: "backend"},
  {key: "state", label: "state"},
  {key: "priority", label: "priority", num: true,
    title: "the vLLM priority the core sends (lower runs first): the tier, then the KV footprint"},
  {key: "prompt_tokens", label: "prompt", num: true},
  {key: "generated_tokens", label: "tokens", num: true},
  {key: "kv_blocks", label: "KV blocks", num: true},
  {key: "prefix_hit_blocks", label: "prefix hits", num: true, optional: true,
    title: "prompt blocks the chosen backend likely holds in its prefix cache"},
  {key: "kv_block_seconds", label: "block-s", num: true, fixed: 1},
  {key: "age_s", label: "age s", num: true, fixed: 1},
];

const sort = {key: "kv_blocks", dir: -1};  // largest KV first, so a cache hog stands out
let shown = [];       // the columns in use (optional ones only when the snapshot has them)
let rows = [];        // every live request, sorted
let rowHeight = 24;   // measured once a row is drawn
const pool = [];      // <tr>s reused from paint to paint
const padTop = padRow(), padBottom = padRow();

function padRow() {
  const tr = document.createElement("tr");
  tr.className = "pad";
  tr.appendChild(document.createElement("td"));
  return tr;
}

function setColumns(requests) {
  const next = COLUMNS.filter(c => !c.optional || requests.some(r => r[c.key] != null));
  if (next.length === shown.length && next.every((c, i) => c === shown[i])) return;
  shown = next;
  $("columns").innerHTML = shown.map(c => `<th data-key="${c.key}" tabindex="0"` +
    `${c.num ? ' class="num"' : ""}` +
    `${c.title ? ` title="${esc(c.title)}"` : ""}>${esc(c.label)}</th>`).join("");
  for (const tr of [padTop, padBottom]) tr.firstChild.colSpan = shown.length;
  for (const tr of pool) tr.remove();
  pool.length = 0;
  markSort();
}

function markSort() {
  for (const th of $("columns").children) {
    th.setAttribute("aria-sort", th.dataset.key === sort.key
      ? (sort.dir > 0 ? "ascending" : "descending") : "none");
  }
}

function compare(a, b) {
  const x = a[sort.key], y = b[sort.key];
  if (x !== y) {
    if (x == null) return 1;  // missing values last, whichever the direction
    if (y == null) return -1;
    return (x < y ? -1 : 1) * sort.dir;
  }
  return a.id - b.id;
}

function renderTable(requests) {
  setColumns(requests);
  rows = requests.slice().sort(compare);
  $("count").textContent = `(${rows.length.toLocaleString("en")})`;
  paintRows();
}

function paintRows() {
  const scroller = $("scroller"), body = $("requests");
  const first = Math.max(0, Math.floor(scroller.scrollTop / rowHeight) - OVERSCAN);
  // The window's height bounds the scroller's (which is only as tall as its rows until full).
  const visible = Math.ceil(window.innerHeight / rowHeight);
  const end = Math.min(rows.length, first + visible + 2 * OVERSCAN);
  while (pool.length < end - first) {
    const tr = document.createElement("tr");
    for (const c of shown) {
      const td = tr.appendChild(document.createElement("td"));
      td.dataset.key = c.key;
      if (c.num) td.className = "num";
    }
    pool.push(tr);
  }
  if (body.firstChild !== padTop) body.prepend(padTop);
  let at = padTop;
  for (let i = first; i < end; i++) {
    const tr = pool[i - first], r = rows[i];
    if (at.nextSibling !== tr) at.after(tr);
    at = tr;
    tr.dataset.id = r.id;
    shown.forEach((c, k) => {
      const v = r[c.key];
      const text = v == null ? "" : c.fixed != null ? v.toFixed(c.fixed) : String(v);
      const td = tr.children[k];
      if (td.textContent !== text) td.textContent = text;
    });
  }
  for (let k = end - first; k < pool.length; k++) pool[k].remove();
  if (at.nextSibling !== padBottom) at.after(padBottom);
  padTop.firstChild.style.height = `${first * rowHeight}px`;
  padBottom.firstChild.style.height = `${(rows.length - end) * rowHeight}px`;
  padTop.hidden = first === 0;
  padBottom.hidden = end === rows.length;
  const drawn = pool[0] && pool[0].isConnected ? pool[0].getBoundingClientRect().height : 0;
  if (drawn > 0 && Math.abs(drawn - rowHeight) > 0.5) { rowHeight = drawn; paintRows(); }
}

function sortBy(th) {
  const column = COLUMNS.find(c => c.key === th.dataset.key);
  if (sort.key === column.key) sort.dir = -sort.dir;
  else Object.assign(sort, {key: column.key, dir: column.num ? -1 : 1});
  markSort();
  rows.sort(compare);
  paintRows();
}

$("columns").addEventListener("click", e => {
  const th = e.target.closest("th");
  if (th) sortBy(th);
});
$("columns").addEventListener("keydown", e => {  // a header has the focus: Enter sorts too
  const th = e.target.closest("th");
  if (th && (e.key === "Enter" || e.key === " ")) { e.preventDefault(); sortBy(th); }
});

let painting = false;
$("scroller").addEventListener("scroll", () => {
  if (painting) return;
  painting = true;
  requestAnimationFrame(() => { painting = false; paintRows(); });
});

// ---- backends, queue, status ----

const bar = f => { const p = Math.max(0, Math.min(1, f || 0)) * 100;
  const cls = p >= 85 ? "fill hot" : p >= 70 ? "fill warn" : "fill";
  return `<div class="bar"><div class="${cls}" style="width:${p.toFixed(1)}%"></div></div>`; };

function renderCards(s) {
  const core = s.core || {};
  $("status").innerHTML =
    `${s.draining ? '<span class="bad">DRAINING</span> ' : ''}running ${core.running ?? 0}` +
    ` &middot; queued ${core.queued ?? 0} &middot; KV blocks ${core.kv_blocks_in_use ?? 0}` +
    ` &middot; shed level ${core.shed_level ?? 0} &middot; up ${s.uptime_s}s`;
  const ledger = Object.fromEntries((core.backends || []).map(b => [b.name, b]));
  $("backends").innerHTML = Object.entries(s.backends || {}).map(
    ([name, b]) => { const l = ledger[name] || {}; const cap = l.kv_capacity_blocks || 0;
      const held = l.kv_blocks_reserved || 0;
      const role = l.role && l.role !== "both" ? ` <span class="muted">${esc(l.role)}</span>` : "";
      return `<div class="card"><b>${esc(name)}</b>${role} <span class="${b.healthy ? "ok" : "bad"}">` +
        `${b.healthy ? "healthy" : "unhealthy"}</span><div class="muted">${esc(b.url)}</div>` +
        `vLLM KV usage ${b.kv_usage == null ? "?" : (100 * b.kv_usage).toFixed(1) + "%"}` +
        bar(b.kv_usage) + `ledger ${held}${cap ? " / " + cap : ""} blocks` +
        bar(cap ? held / cap : 0) + `running ${b.running ?? "?"} (cap ${l.cap ?? "?"}),` +
        ` waiting ${b.waiting ?? "?"}, preemptions ${b.preemptions_total ?? "?"}</div>`; }
  ).join("");
  $("queue").innerHTML = Object.entries(core.queued_by_tier || {}).map(
    ([tier, n]) => `<div class="card"><b>${esc(tier)}</b>: ${n}</div>`).join("");
}

// One snapshot onto the page: a sample into the ring, the charts, the cards, the table.
function render(s) {
  addSample(s);
  drawCharts();
  renderCards(s);
  renderTable((s.core || {}).requests || []);
}

async function poll() {
  try {
    const r = await fetch("api/state");
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    render(await r.json());
  } catch (e) {
    $("status").textContent = "gateway unreachable: " + e;
  }
  setTimeout(poll, POLL_MS);
}
poll();
