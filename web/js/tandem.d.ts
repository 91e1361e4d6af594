// Types of tandem.js: the worker-backed Tandem (the engine in a Web Worker).
import type {
  ChatMessage, FinishReason, GenerateOptions, LoadOptions, ModelSource, TandemInfo,
} from "./tandem_web.js";

export type { ChatMessage, FinishReason, GenerateOptions, LoadOptions, LoadProgress, ModelSource, TandemInfo }
  from "./tandem_web.js";

export declare const DEFAULT_CACHE: "tandem-models-v1";

export interface WorkerOptions {
  /** Where worker.js is; by default beside tandem.js. */
  workerUrl?: string | URL;
}

export declare class Tandem {
  /** Starts the engine's worker, with no model loaded yet. */
  constructor(options?: WorkerOptions);
  /** A new engine (its own worker) with the model from `source` loaded. */
  static load(source: ModelSource, options?: LoadOptions & WorkerOptions): Promise<Tandem>;
  /** Replaces the loaded model; a running generation stops first. */
  load(source: ModelSource, options?: LoadOptions): Promise<Tandem>;
  generate(prompt: string, options?: GenerateOptions): AsyncIterable<string>;
  chat(messages: ChatMessage[], options?: GenerateOptions): AsyncIterable<string>;
  /** Stops the running generation after its step in flight. */
  abort(): Promise<void>;
  info(): TandemInfo & { wasmMemoryBytes: number };
  generatedTokens(): Uint32Array;
  finishReason(): FinishReason | null;
  /** Ends the worker and releases the model. */
  free(): void;
  static cachedModels(cache?: string): Promise<{ url: string; bytes: number | null }[]>;
  static deleteCached(url: string | URL, cache?: string): Promise<boolean>;
}
