// The playground: one chat streamed through llmflow-client.js by a renderer the user slows down.
// What it shows comes from three places: the client library (window, seq, tokens per chunk),
// the page's own renderer (what it drew), and /api/state (the gateway's view of the request).
import { stream, chunkText, LlmflowError } from "/static/llmflow-client.js";

const $ = (id) => document.getElementById(id);
const HISTORY = 120; // chart samples: 30 s at 4 per second
const SAMPLE_MS = 250;
const MIN_SPAN = 24; // the chart's width in samples until the history is longer (6 s)
const STATE_POLL_MS = 500;

const view = {
  tokens: 0, chunks: 0, merged: 0, largest: 0, chars: 0, counted: false,
  window: null, unacked: 0, requestId: null, buffered: null,
  history: [], // [unacked, held in the gateway] per sample
};
let controller = null;
let resume = null; // resolves the renderer's wait while "stop rendering" is checked

function apiKey() {
  return document.documentElement.dataset.auth === "required" ? $("api-key").value : undefined;
}

function setStatus(kind, text) {
  const pill = $("status");
  pill.className = `pill ${kind}`;
  pill.textContent = text ?? kind;
}

async function loadModels() {
  const headers = apiKey() ? { Authorization: `Bearer ${apiKey()}` } : {};
  try {
    const reply = await fetch("/v1/models", { headers });
    if (!reply.ok) return;
    const models = (await reply.json()).data ?? [];
    $("model").replaceChildren(...models.map((m) => new Option(m.id, m.id)));
  } catch {
    // the list stays empty until a key is given
  }
}

function delayMs() {
  return Number($("delay").value);
}

async function render(chunk, info) {
  while ($("paused").checked) await new Promise((r) => (resume = r));
  const text = chunkText(chunk);
  if (text) $("output").append(text); // a text node per chunk: no re-parse of what is there
  // Tokens per chunk come from the chunk's usage; a backend without continuous usage stats
  // sends none, and then the page cannot tell a merged chunk from a single one.
  if (info.tokens !== null) {
    view.counted = true;
    view.tokens += info.tokens;
    if (info.tokens > 1) view.merged += 1;
    view.largest = Math.max(view.largest, info.tokens);
  }
  view.chunks += 1;
  view.chars += text.length;
  paintCounts();
  const ms = delayMs();
  if (ms > 0) await new Promise((r) => setTimeout(r, ms));
}

function paintCounts() {
  const unknown = view.chunks > 0 && !view.counted; // no usage in the chunks: no token counts
  $("tokens").textContent = unknown ? "–" : view.tokens;
  $("chunks").textContent = view.chunks;
  $("merged").textContent = unknown ? "–" : view.merged;
  $("largest").textContent = unknown
    ? "the backend sends no per-chunk usage"
    : `largest: ${view.largest} token${view.largest === 1 ? "" : "s"}`;
  $("rendered-chars").textContent = `${view.chars.toLocaleString("en")} chars`;
}

function paintWindow() {
  $("unacked").textContent = view.unacked;
  $("window").textContent = view.window ?? "none (SSE)";
  const full = view.window && view.unacked >= view.window;
  $("window-fill").style.width = view.window ? `${(100 * view.unacked) / view.window}%` : "0";
  $("window-fill").classList.toggle("full", Boolean(full));
  if (controller) setStatus(full ? "held" : "streaming", full ? "held back" : "streaming");
}

function paintChart() {
  const svg = $("chart");
  const span = Math.max(MIN_SPAN, view.history.length); // fills from the left, then scrolls
  const top = 1.25 * Math.max(4, view.window ?? 0, ...view.history.map(([u, b]) => Math.max(u, b ?? 0)));
  const line = (pick) =>
    view.history
      .map((s, i) => `${i ? "L" : "M"}${((300 * i) / (span - 1)).toFixed(1)},${(86 - (80 * (pick(s) ?? 0)) / top).toFixed(1)}`)
      .join("");
  const cap = view.window ? 86 - (80 * view.window) / top : null;
  svg.innerHTML =
    (cap === null ? "" : `<line x1="0" x2="300" y1="${cap}" y2="${cap}" stroke="#f59e0b" stroke-dasharray="4 3"/>`) +
    (view.history.length > 1
      ? `<path d="${line((s) => s[1])}L${((300 * (view.history.length - 1)) / (span - 1)).toFixed(1)},86L0,86Z" fill="#06b6d4" fill-opacity=".18" stroke="#06b6d4" stroke-width="1.5" vector-effect="non-scaling-stroke"/>`
      : "") +
    `<path d="${line((s) => s[0])}" fill="none" stroke="#6366f1" stroke-width="2" vector-effect="non-scaling-stroke"/>`;
  svg.dataset.points = view.history.length;
}

async function pollState() {
  if (view.requestId === null) return;
  let reply;
  try {
    reply = await fetch("/api/state", { cache: "no-store" });
  } catch {
    return;
  }
  if (!reply.ok) {
    $("server-note").textContent =
      reply.status === 401 ? "/api/state needs the admin key here" : `/api/state answered ${reply.status}`;
    return;
  }
  const state = await reply.json();
  const row = (state.core?.requests ?? []).find((r) => r.id === view.requestId);
  const live = (state.streams ?? []).find((s) => s.id === view.requestId);
  view.buffered = live ? live.window : null;
  const cells = { id: view.requestId, ...(row ?? { state: "ended" }), buffered: live ? `${live.window} chunks` : "–" };
  for (const td of document.querySelectorAll("#server td[data-key]")) {
    const value = cells[td.dataset.key];
    td.textContent = value === undefined || value === null ? "–" : td.dataset.key === "age_s" ? `${value.toFixed(1)} s` : value;
  }
  $("server-note").textContent = row ? "" : "the gateway no longer holds this request";
}

function requestBody() {
  const body = {
    model: $("model").value,
    messages: [{ role: "user", content: $("prompt").value }],
    max_tokens: Number($("max-tokens").value),
    stream_options: { include_usage: true, continuous_usage_stats: true }, // tokens per chunk
  };
  const extra = $("extra").value.trim();
  return extra ? { ...body, ...JSON.parse(extra) } : body;
}

function reset() {
  Object.assign(view, { tokens: 0, chunks: 0, merged: 0, largest: 0, chars: 0, counted: false, unacked: 0, requestId: null, buffered: null, window: null });
  $("output").replaceChildren();
  for (const td of document.querySelectorAll("#server td[data-key]")) td.textContent = "–";
  paintCounts();
  paintWindow();
}

async function send() {
  reset();
  view.history = [];
  let body;
  try {
    body = requestBody();
  } catch (error) {
    $("result").className = "result bad";
    $("result").textContent = `extra body fields: ${error.message}`;
    return;
  }
  controller = new AbortController();
  $("send").disabled = true;
  $("cancel").disabled = false;
  $("result").className = "result";
  $("result").textContent = "waiting for the first token…";
  setStatus("streaming", "waiting");
  const poll = setInterval(pollState, STATE_POLL_MS);
  try {
    const result = await stream(body, {
      apiKey: apiKey(),
      transport: $("transport").value,
      signal: controller.signal,
      onChunk: render,
      onStart: ({ window, requestId }) => {
        view.window = window;
        view.requestId = requestId;
        $("result").textContent = "streaming";
        paintWindow();
        pollState();
      },
      onWindow: (state) => {
        view.unacked = state.received - state.acked;
        paintWindow();
      },
    });
    const cut = result.truncated ? ` · cut: ${result.truncated.reason}` : "";
    $("result").textContent = `${result.reason} · ${result.sent} chunks sent${cut}`;
    setStatus(result.reason === "completed" ? "done" : "failed", result.reason);
  } catch (error) {
    $("result").className = "result bad";
    if (error instanceof LlmflowError) {
      const retry = error.retryAfter ? ` · retry after ${error.retryAfter} s` : "";
      $("result").textContent = `${error.status} ${error.code ?? ""}: ${error.message}${retry}`;
      setStatus("failed", String(error.status));
    } else {
      $("result").textContent = error.name === "AbortError" ? "cancelled" : String(error);
      setStatus("failed", error.name === "AbortError" ? "cancelled" : "failed");
    }
  } finally {
    clearInterval(poll);
    controller = null;
    view.unacked = 0;
    paintWindow();
    await pollState();
    $("send").disabled = false;
    $("cancel").disabled = true;
  }
}

$("send").addEventListener("click", send);
$("cancel").addEventListener("click", () => controller?.abort());
$("delay").addEventListener("input", () => {
  $("delay-label").textContent = `${delayMs()} ms`;
});
$("paused").addEventListener("change", () => {
  if (!$("paused").checked && resume) resume();
});
$("api-key").addEventListener("change", loadModels);
setInterval(() => {
  view.history.push([view.unacked, view.buffered]);
  if (view.history.length > HISTORY) view.history.shift();
  paintChart();
}, SAMPLE_MS);
reset();
loadModels();
