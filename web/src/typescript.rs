//! The API's TypeScript declarations, beyond what `wasm_bindgen` derives
//! from the Rust signatures: the option objects, model sources and chat
//! messages, emitted into the package's `.d.ts`.

use wasm_bindgen::prelude::*;

#[wasm_bindgen(typescript_custom_section)]
const TYPESCRIPT_TYPES: &str = r#"
/**
 * A GGUF model: a URL (fetched with a streamed body, and cached), a Response,
 * a Blob or File, or bytes (copied into wasm memory: the caller keeps its own
 * copy, so a URL, Response or Blob takes half the memory).
 */
export type ModelSource = string | URL | Response | Blob | ArrayBuffer | Uint8Array;
/**
 * One progress report of `Tandem.load`. Phases, in order: "download" (a URL,
 * from the network), "cache" (a URL, from the browser's cache) or "read" (a
 * Response, Blob, File or bytes handed in); then "store" (writing a download
 * to the cache: one report before, one after) and "upload" (weights to the
 * backend).
 * `done` and `total` count bytes; `total` is null when the server sent no
 * length.
 */
export interface LoadProgress {
  phase: "download" | "cache" | "read" | "store" | "upload";
  done: number;
  total: number | null;
}
export interface LoadOptions {
  /**
   * "auto" (default): the faster of WebGPU and the CPU backend in wasm,
   * timed on the same short matrix-vector product (a software rasterizer
   * such as SwiftShader, llvmpipe or lavapipe loses to the CPU); the CPU
   * where WebGPU is missing or does not open.
   */
  backend?: "auto" | "webgpu" | "cpu";
  onProgress?: (progress: LoadProgress) => void;
  /**
   * Where a model loaded from a URL is kept: true (default) for the Cache API
   * cache "tandem-models-v1", a string for another cache, false for none.
   * Only a download that arrived whole (as long as its Content-Length) and
   * parsed as a model is stored; a bad cached copy is dropped and the model
   * downloaded again.
   */
  cache?: boolean | string;
  /**
   * How the KV cache stores keys and values: "f32" (default), "f16", "int8"
   * (per token, groups of 32), "int4" or "int2" (keys per channel over each
   * KV block, values per token), as `--kv-dtype` natively.
   */
  kvDtype?: "f32" | "f16" | "int8" | "int4" | "int2";
  /**
   * Threads of the CPU backend, its own included (default: one per core,
   * navigator.hardwareConcurrency). More than one needs the threaded
   * package (pkg/threads, which worker.js takes where the page is
   * cross-origin isolated) with its thread pool started; `info().threads`
   * says how many run, `threadsReason` why fewer than asked.
   */
  threads?: number;
}
export interface ChatMessage {
  role: string;
  content: string;
}
export interface GenerateOptions {
  maxTokens?: number;
  temperature?: number;
  topP?: number;
  seed?: number;
  /**
   * KV eviction, as `--kv-budget` natively: the generation keeps at most
   * this much KV, a token count or a percentage of the context ("25%"), in
   * whole blocks of 16 tokens. Without it the other kv options are refused.
   */
  kvBudget?: number | string;
  /**
   * Which blocks go once over the budget: "h2o" (default: the least
   * attended), "snapkv" (the prompt's blocks, chosen once from its last
   * queries; generated blocks only once no prompt block is left) or
   * "streaming" (the oldest after the sinks).
   */
  kvEvict?: "h2o" | "snapkv" | "streaming";
  /** Leading tokens always kept (default 4). */
  kvSinks?: number;
  /** Newest tokens always kept (default: half the rest of the budget). */
  kvRecent?: number;
}
/** Why a generation ended: an end-of-text token, `maxTokens`, or stopped. */
export type FinishReason = "stop" | "length" | "abort";
export interface TandemInfo {
  model: string;
  /** Where the model's bytes came from. */
  source: "network" | "cache" | "caller";
  /** Size of the model file in bytes. */
  modelBytes: number;
  backend: "webgpu" | "cpu";
  /** Why this backend runs (asked for; a hardware adapter; why WebGPU was not taken). */
  backendReason: string;
  adapter: string;
  features: { shaderF16: boolean; subgroups: boolean; usesF16: boolean; usesSubgroups: boolean };
  fallbackReason: string | null;
  kvDtype: "f32" | "f16" | "int8" | "int4" | "int2";
  /** KV-cache bytes per token of context, all layers. */
  kvBytesPerToken: number;
  /** Tokens per sequence, prompt and output together (what a kvBudget percentage is of). */
  context: number;
  /** Threads the CPU backend runs on; null on WebGPU. */
  threads: number | null;
  /** Why the CPU backend runs on fewer threads than asked for; null when it does not. */
  threadsReason: string | null;
}
"#;
