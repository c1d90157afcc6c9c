// Types of llmflow-client.js, the browser client of the llmflow gateway (docs/browser-client.md).

/** The WebSocket subprotocol the gateway answers with: `"llmflow.v1"`. */
export declare const PROTOCOL: "llmflow.v1";

/** One OpenAI stream chunk (`chat.completion.chunk` or `text_completion`), as the gateway sends it. */
export interface Chunk {
  id?: string;
  object?: string;
  model?: string;
  choices: Array<{
    index: number;
    delta?: { role?: string; content?: string | null; [key: string]: unknown };
    text?: string;
    finish_reason?: string | null;
    [key: string]: unknown;
  }>;
  usage?: { prompt_tokens: number; completion_tokens: number; total_tokens: number } | null;
  /** Present on the chunk that ends a reply the gateway cut. */
  llmflow?: { truncated: true; reason: string };
  [key: string]: unknown;
}

/** What the stream knows when it hands a chunk to `onChunk`. */
export interface ChunkInfo {
  /** 1, 2, 3, ... per request. */
  seq: number;
  /** The most chunks the gateway leaves unacknowledged; `null` over SSE (no window). */
  window: number | null;
  /** Chunks received and not yet acknowledged, this one included; `null` over SSE. */
  unacked: number | null;
  /** Completion tokens in this chunk (more than 1: the gateway merged chunks that waited);
   *  `null` unless the request asked for `stream_options.continuous_usage_stats`. */
  tokens: number | null;
}

/** The flow-control state, as `onWindow` reports it after every chunk received or acknowledged. */
export interface WindowState {
  window: number;
  /** Highest `seq` received. */
  received: number;
  /** Highest `seq` acknowledged (rendered). `received - acked` never exceeds `window`. */
  acked: number;
  /** The gateway's id of the request (the `id` of its row in `/api/state`), once started. */
  requestId: number | null;
}

export interface StreamOptions {
  /** Called for each chunk in order; the chunk is acknowledged once its promise resolves. */
  onChunk?: (chunk: Chunk, info: ChunkInfo) => void | Promise<void>;
  /** Abort: cancels the request, which the gateway aborts upstream. The promise rejects with
   *  `signal.reason`. */
  signal?: AbortSignal;
  /** The gateway (`https://host:port`, or its `wss://` URL); default: the one serving this module. */
  url?: string;
  /** The API key, when the gateway has keys configured. */
  apiKey?: string;
  /** Default: `"chat"` when the request has `messages`, else `"completions"`. */
  endpoint?: "chat" | "completions";
  /** `"websocket"` (default, with the window) or `"sse"` (fetch + ReadableStream: NO window,
   *  the gateway is held back only by TCP once megabytes of buffers have filled). */
  transport?: "websocket" | "sse";
  /** Admitted and the first token is ready: the window, and the gateway's request id. */
  onStart?: (start: { window: number | null; requestId: number | null }) => void;
  /** Flow-control state after every chunk received or acknowledged (WebSocket only). */
  onWindow?: (state: WindowState) => void;
}

/** How a stream ended, once its last chunk has been rendered. */
export interface StreamResult {
  /** `completed`, or why the gateway ended it early: `deadline`, `shutdown`, `client_stall`, ... */
  reason: string;
  /** The last `seq`. */
  sent: number;
  /** Set when the reply was cut: why, and the notice text the last chunk carried (also
   *  rendered through `onChunk`), or `null` when there was none (`client_stall`). */
  truncated: { reason: string; notice: string | null } | null;
  /** The last usage seen, when the request asked for it. */
  usage: Chunk["usage"] | null;
  /** The gateway's request id (WebSocket only). */
  requestId: number | null;
}

/** A refusal or failure, with the status the same request gets over HTTP: 400, 401, 404,
 *  429 (with `retryAfter`), 502, 503, 504. A connection lost mid-stream is a 502
 *  `connection_lost`; a refused WebSocket upgrade is the HTTP route's answer to the same key
 *  (401) or a 503 `websocket_refused`. */
export declare class LlmflowError extends Error {
  readonly name: "LlmflowError";
  readonly status: number;
  readonly code: string | null;
  readonly type: string | null;
  readonly param: string | null;
  /** Seconds to wait before retrying (429, 503), else `null`. */
  readonly retryAfter: number | null;
}

/** Stream one OpenAI request body through the gateway. Resolves once the last chunk has been
 *  rendered; rejects with `LlmflowError`, or with `signal.reason` when aborted. Never retries. */
export declare function stream(request: Record<string, unknown>, options?: StreamOptions): Promise<StreamResult>;

/** The text of a chunk: every choice's `delta.content` (chat) or `text` (completions). */
export declare function chunkText(chunk: Chunk): string;

/** The `/v1/ws` URL of the gateway at `base`, or of the one serving this module. */
export declare function socketUrl(base?: string): string;
