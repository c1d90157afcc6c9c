// llmflow-client: stream a completion into a page at the page's own rendering speed.
//
// Over the gateway's WebSocket acknowledgement protocol (docs/protocol-websocket.md) a chunk is
// acknowledged only once `onChunk` has finished with it (its promise resolved), so the gateway
// never has more than `window` chunks unacknowledged: a slow page makes the gateway hold back,
// merge what waits, and stop reading from vLLM; the page's memory holds at most `window`
// chunks. No dependencies, no build step: `import { stream } from "/static/llmflow-client.js"`.
// Typed in llmflow-client.d.ts beside this file; documented in docs/browser-client.md.

export const PROTOCOL = "llmflow.v1"; // the WebSocket subprotocol the gateway answers with
const KEY_PREFIX = "llmflow.key."; // + base64url(API key): browsers cannot set headers on a socket

/** A refusal or failure, with the status the same request would get over HTTP. */
export class LlmflowError extends Error {
  constructor(status, error = {}, retryAfter = null) {
    super(error.message || `llmflow: request failed with status ${status}`);
    this.name = "LlmflowError";
    this.status = status;
    this.code = error.code ?? null;
    this.type = error.type ?? null;
    this.param = error.param ?? null;
    this.retryAfter = retryAfter; // seconds, on a 429 or 503: when to try again
  }
}

/** The text a chunk carries: every choice's content (chat) or text (completions), in order. */
export function chunkText(chunk) {
  let text = "";
  for (const choice of chunk?.choices ?? []) {
    text += choice.delta?.content ?? choice.text ?? "";
  }
  return text;
}

/**
 * Stream one request. Resolves with how it ended once the last chunk has been rendered.
 *
 * @param {object} request the OpenAI body (`messages` for chat, `prompt` for completions)
 * @param {import("./llmflow-client.js").StreamOptions} options
 */
export function stream(request, options = {}) {
  options.signal?.throwIfAborted();
  return options.transport === "sse" ? streamSse(request, options) : streamWebSocket(request, options);
}

/** The `/v1/ws` URL of a gateway: `base` (http(s) or ws(s)), else the one serving this module. */
export function socketUrl(base) {
  const url = new URL("/v1/ws", base ?? import.meta.url);
  url.protocol = url.protocol === "https:" || url.protocol === "wss:" ? "wss:" : "ws:";
  return url.href;
}

function httpUrl(path, base) {
  const url = new URL(path, base ?? import.meta.url);
  if (url.protocol === "ws:" || url.protocol === "wss:") url.protocol = url.protocol === "wss:" ? "https:" : "http:";
  return url.href;
}

function endpointOf(request, options) {
  return options.endpoint ?? (request.messages ? "chat" : "completions");
}

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  let binary = "";
  for (const b of bytes) binary += String.fromCharCode(b);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function protocolsFor(apiKey) {
  return apiKey ? [PROTOCOL, KEY_PREFIX + base64url(apiKey)] : [PROTOCOL];
}

let nextId = 1;

function streamWebSocket(request, options) {
  const { onChunk, onStart, onWindow, signal, apiKey } = options;
  const endpoint = endpointOf(request, options);
  const id = nextId++;
  return new Promise((resolve, reject) => {
    const state = { window: 0, received: 0, acked: 0, requestId: null };
    const inbox = []; // messages received, not yet handled: at most `window` chunks and an end
    let socket = null;
    let opened = false;
    let settled = false;
    let pumping = false;
    let truncated = null;
    let usage = null;
    let tokens = 0; // completion tokens so far, from the chunks' usage when they carry it

    const settle = (fn, value) => {
      if (settled) return;
      settled = true;
      signal?.removeEventListener("abort", onAbort);
      if (socket && socket.readyState <= WebSocket.OPEN) socket.close(1000);
      fn(value);
    };
    const fail = (error) => settle(reject, error);
    const onAbort = () => {
      if (socket?.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "cancel" }));
      fail(signal.reason ?? new DOMException("aborted", "AbortError"));
    };
    signal?.addEventListener("abort", onAbort, { once: true });

    const handle = async (msg) => {
      if (msg.type === "start") {
        state.window = msg.window;
        state.requestId = msg.request_id ?? null;
        onStart?.({ window: msg.window, requestId: state.requestId });
      } else if (msg.type === "chunk") {
        const data = msg.data;
        if (data?.error) throw inBandError(data.error);
        if (data?.llmflow?.truncated) truncated = { reason: data.llmflow.reason, notice: chunkText(data) };
        let chunkTokens = null;
        if (data?.usage?.completion_tokens != null) {
          chunkTokens = data.usage.completion_tokens - tokens;
          tokens = data.usage.completion_tokens;
          usage = data.usage;
        }
        const info = { seq: msg.seq, window: state.window, unacked: state.received - state.acked, tokens: chunkTokens };
        await onChunk?.(data, info); // however long the page needs: the ack waits for it
        if (settled) return;
        state.acked = msg.seq;
        socket.send(JSON.stringify({ type: "ack", id, seq: msg.seq }));
        onWindow?.({ ...state });
      } else if (msg.type === "end") {
        if (msg.reason !== "completed" && !truncated) truncated = { reason: msg.reason, notice: null };
        settle(resolve, { reason: msg.reason, sent: msg.sent, truncated, usage, requestId: state.requestId });
      } else if (msg.type === "error") {
        throw new LlmflowError(msg.status, msg.error, msg.retry_after ?? null);
      } else if (msg.type === "closed") {
        throw lost(`the gateway closed the connection mid-stream (code ${msg.code})`);
      }
    };
    const pump = async () => {
      if (pumping) return;
      pumping = true;
      try {
        while (inbox.length && !settled) await handle(inbox.shift());
      } catch (error) {
        fail(error);
      } finally {
        pumping = false;
      }
    };

    socket = new WebSocket(socketUrl(options.url), protocolsFor(apiKey));
    socket.onopen = () => {
      opened = true;
      socket.send(JSON.stringify({ type: "request", id, endpoint, body: request }));
    };
    socket.onmessage = (event) => {
      const msg = JSON.parse(event.data);
      if (msg.id !== id && msg.id !== null) return;
      if (msg.type === "chunk") state.received = msg.seq;
      inbox.push(msg);
      onWindow?.({ ...state });
      pump();
    };
    socket.onclose = (event) => {
      if (settled) return;
      if (!opened) return refusedUpgrade(apiKey, options.url).then(fail, fail);
      inbox.push({ type: "closed", code: event.code }); // after the chunks already here
      pump();
    };
  });
}

async function refusedUpgrade(apiKey, base) {
  // A browser never shows why a WebSocket handshake failed; the same key on an HTTP route says.
  try {
    const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
    const reply = await fetch(httpUrl("/v1/models", base), { headers });
    if (!reply.ok) return await httpError(reply);
  } catch {
    // not reachable over HTTP either: fall through
  }
  return new LlmflowError(503, { message: "the gateway refused the WebSocket (wrong origin, or not reachable)", type: "service_unavailable", code: "websocket_refused" });
}

function inBandError(error) {
  const status = Number.isInteger(error.code) && error.code >= 400 ? error.code : 502;
  return new LlmflowError(status, error);
}

async function httpError(reply) {
  let error = {};
  try {
    error = (await reply.json()).error ?? {};
  } catch {
    error = { message: `HTTP ${reply.status}` };
  }
  const retry = reply.headers.get("Retry-After");
  return new LlmflowError(reply.status, error, retry === null ? null : Number(retry));
}

// SSE fallback: fetch + ReadableStream over the plain HTTP route. It has NO window: awaiting
// onChunk only stops this reader, and the gateway is held back by TCP alone, after its and the
// kernel's buffers (megabytes) have filled. Use it where a WebSocket cannot go.
async function streamSse(request, options) {
  const { onChunk, onStart, signal, apiKey } = options;
  const path = endpointOf(request, options) === "chat" ? "/v1/chat/completions" : "/v1/completions";
  const headers = { "Content-Type": "application/json", Accept: "text/event-stream" };
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  const reply = await fetch(httpUrl(path, options.url), {
    method: "POST",
    headers,
    body: JSON.stringify({ ...request, stream: true }),
    signal,
  }).catch((error) => {
    throw signal?.aborted ? error : lost(`the gateway could not be reached (${error.message})`);
  });
  if (!reply.ok) throw await httpError(reply);
  onStart?.({ window: null, requestId: null });
  const reader = reply.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let seq = 0;
  let truncated = null;
  let usage = null;
  let tokens = 0;
  for (;;) {
    const { value, done } = await reader.read().catch((error) => {
      throw signal?.aborted ? error : lost(`the stream broke off (${error.message})`);
    });
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("");
      if (!data) continue;
      if (data === "[DONE]") {
        return { reason: truncated ? truncated.reason : "completed", sent: seq, truncated, usage, requestId: null };
      }
      const chunk = JSON.parse(data);
      if (chunk.error) throw inBandError(chunk.error);
      if (chunk.llmflow?.truncated) truncated = { reason: chunk.llmflow.reason, notice: chunkText(chunk) };
      let chunkTokens = null;
      if (chunk.usage?.completion_tokens != null) {
        chunkTokens = chunk.usage.completion_tokens - tokens;
        tokens = chunk.usage.completion_tokens;
        usage = chunk.usage;
      }
      seq += 1;
      await onChunk?.(chunk, { seq, window: null, unacked: null, tokens: chunkTokens });
    }
  }
  throw lost("the stream ended without [DONE]");
}

function lost(message) {
  return new LlmflowError(502, { message, type: "bad_gateway", code: "connection_lost" });
}
