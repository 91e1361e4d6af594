//! Tandem in the browser: the `Tandem` class that JavaScript sees.
//!
//! ```js
//! const engine = await Tandem.load(url, { onProgress, backend: "auto" });
//! for await (const piece of engine.generate(prompt, { maxTokens, temperature, topP, seed })) { ... }
//! for await (const piece of engine.chat([{ role: "user", content }], { maxTokens })) { ... }
//! engine.abort(); engine.info(); engine.finishReason();
//! ```
//!
//! The model's bytes stream into wasm memory (`source`: fetch, Cache API,
//! progress). The model runs on the browser's WebGPU (`tandem-wgpu`); where
//! `navigator.gpu` is missing, no adapter opens or the CPU times faster
//! (`choose`), on the CPU backend: on one thread, or on several in the
//! threaded package (`threads`). `js/` wraps this class in a Web Worker for
//! pages (`tandem.js`, the same API over messages). Every engine step reads
//! its tokens back with an async download (blocking is not allowed on the
//! browser's main thread), so each `next()` of a generation is one
//! `Engine::begin_step` / `finish_step` pair.
//! Errors become JavaScript exceptions; nothing panics across the boundary.

mod choose;
mod options;
mod probe;
mod runtime;
mod source;
mod threads;

use std::cell::{Cell, RefCell};
use std::path::Path;
use std::rc::{Rc, Weak};
use std::sync::Arc;

use js_sys::{Function, Object, Uint32Array};
use wasm_bindgen::prelude::*;

use tandem_core::backend::KvDtype;
use tandem_core::engine::{Engine, EngineConfig, FinishReason};
use tandem_core::kv::SeqId;
use tandem_core::model::gguf::{model_from_gguf, GgufFile};
use tandem_core::model::{Bytes, ModelFiles};
use tandem_core::sched::SamplingParams;
use tandem_core::tokenizer::{StreamDecoder, Tokenizer};
use tandem_core::Backend;

use choose::{choose, Asked, Chosen};
use options::{
    cache_option, chat_messages, eviction_option, get, number_option, string_option, CpuThreads,
    Features, Info,
};
use runtime::{AnyEngine, Runtime};
use source::{Origin, Progress};

/// The threaded package only: `initThreadPool(helpers)` starts rayon's
/// global pool on that many Web Workers (wasm-bindgen-rayon). It must run
/// once, before the first load: the CPU backend borrows the pool's threads
/// (`tandem_cpu`'s `workers/wasm.rs`), and anything touching rayon first
/// would fix the pool at the caller's thread alone.
#[cfg(target_feature = "atomics")]
pub use wasm_bindgen_rayon::init_thread_pool;

/// Tokens of context the KV cache holds (f32 K/V: SmolLM2-135M takes 90 MiB).
const CONTEXT_TOKENS: usize = 2048;
const DEFAULT_MAX_TOKENS: usize = 128;

#[wasm_bindgen(inline_js = r#"
export function asyncPieces(generation) {
  return {
    [Symbol.asyncIterator]() { return this; },
    async next() {
      const piece = await generation.next();
      return piece === undefined ? { done: true, value: undefined } : { done: false, value: piece };
    },
    async return() {
      generation.stop();
      return { done: true, value: undefined };
    },
  };
}
"#)]
extern "C" {
    /// Wraps a [`Generation`] as an async iterable of text pieces.
    #[wasm_bindgen(js_name = asyncPieces)]
    fn async_pieces(generation: Generation) -> JsValue;
}

#[wasm_bindgen]
extern "C" {
    #[wasm_bindgen(js_namespace = console)]
    fn warn(message: &str);
}

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

/// A loaded model, ready to generate.
#[wasm_bindgen]
pub struct Tandem {
    shared: Rc<Shared>,
    info: Info,
}

/// What the engine and its generations share.
struct Shared {
    runtime: RefCell<Runtime>,
    /// The sequence being generated; a new generation or `abort` ends it.
    active: Cell<Option<SeqId>>,
    /// Token ids generated by the latest generation.
    generated: RefCell<Vec<u32>>,
    /// Why the latest generation ended; `None` while it runs.
    finish: Cell<Option<Finish>>,
}

/// Why a generation ended (`finishReason()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Finish {
    /// An end-of-text token.
    Stop,
    /// `maxTokens` or the context's end.
    Length,
    /// `abort()`, a new generation, or the iterator left early.
    Abort,
}

impl Finish {
    fn name(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Abort => "abort",
        }
    }
}

impl From<FinishReason> for Finish {
    fn from(reason: FinishReason) -> Finish {
        match reason {
            FinishReason::Stop => Finish::Stop,
            FinishReason::Length => Finish::Length,
        }
    }
}

impl Shared {
    /// Ends the running generation. When a step of it is in flight (the
    /// runtime is borrowed), the step removes the sequence once it is back.
    /// A generation whose last token already came keeps its finish reason.
    fn abort(&self) {
        let Some(seq) = self.active.take() else {
            return;
        };
        if self.finish.get().is_none() {
            self.finish.set(Some(Finish::Abort));
        }
        if let Ok(mut runtime) = self.runtime.try_borrow_mut() {
            runtime.remove(seq);
        }
    }
}

#[wasm_bindgen]
impl Tandem {
    /// Loads a GGUF model from `source`: a URL (string or URL: fetched with
    /// a streamed body and kept in the Cache API), a Response, a Blob or
    /// File, an ArrayBuffer or a Uint8Array. `options.onProgress({ phase,
    /// done, total })` follows reading the bytes and uploading the weights;
    /// `options.backend` is `"auto"` (the faster of WebGPU and the CPU,
    /// timed: `choose`), `"webgpu"` or
    /// `"cpu"`; `options.cache` is `true` (default), a cache name, or `false`;
    /// `options.kvDtype` is the KV cache's storage (`"f32"` by default);
    /// `options.threads` the CPU backend's threads (`threads`).
    pub async fn load(
        #[wasm_bindgen(unchecked_param_type = "ModelSource")] source: JsValue,
        #[wasm_bindgen(unchecked_optional_param_type = "LoadOptions")] options: Option<Object>,
    ) -> Result<Tandem, JsError> {
        let options = options.unwrap_or_default();
        let asked = Asked::parse(
            string_option(&options, "backend")?
                .as_deref()
                .unwrap_or("auto"),
        )
        .map_err(|e| JsError::new(&e))?;
        let cache = cache_option(&options)?;
        let kv_dtype = match string_option(&options, "kvDtype")? {
            Some(name) => name
                .parse::<KvDtype>()
                .map_err(|e| JsError::new(&format!("kvDtype: {e}")))?,
            None => KvDtype::F32,
        };
        let asked_threads = threads::asked(number_option(&options, "threads")?)?;
        let progress = Progress::new(get(&options, "onProgress")?.dyn_into::<Function>().ok());
        let loaded = read_model(&source, cache.as_deref(), &progress).await?;
        if let (Origin::Network, Some(cache), Some(key)) =
            (loaded.origin, cache.as_deref(), loaded.cache_key.as_deref())
        {
            let len = loaded.bytes.len();
            progress.report("store", 0, Some(len));
            // A model that cannot be cached still runs.
            match source::store(cache, key, &loaded.bytes).await {
                Ok(()) => progress.report("store", len, Some(len)),
                Err(e) => warn(&format!("tandem: {key} was not cached: {e}")),
            }
        }
        let files = loaded.files;
        let mut upload = |done: usize, total: usize| progress.report("upload", done, Some(total));
        let model = files
            .metadata
            .iter()
            .find(|(key, _)| key == "general.name")
            .map_or_else(|| "unnamed model".into(), |(_, v)| v.clone());
        let context = CONTEXT_TOKENS.min(files.config.max_context);
        let config = EngineConfig {
            max_context: Some(context),
            kv_precision: kv_dtype.into(),
            ..EngineConfig::default()
        }
        .with_capacity_tokens(context);

        let (cpu_backend, fewer_threads) = threads::cpu_backend(asked_threads);
        let chosen = choose(asked, cpu_backend)
            .await
            .map_err(|e| JsError::new(&e))?;
        let (engine, adapter, features, backend_reason, threads) = match chosen {
            Chosen::WebGpu { backend, reason } => {
                let a = backend.adapter();
                // The browser may hide the adapter's name and driver.
                let adapter = [a.name.as_str(), &a.device_type, &a.driver]
                    .into_iter()
                    .filter(|part| !part.is_empty())
                    .collect::<Vec<_>>()
                    .join(", ");
                let features = Features {
                    shader_f16: a.shader_f16,
                    subgroups: a.subgroups,
                    uses_f16: backend.uses_f16(),
                    uses_subgroups: backend.uses_subgroups(),
                };
                let engine =
                    Engine::new(*backend, &files, config, &mut upload).map_err(js_error)?;
                (
                    AnyEngine::WebGpu(Box::new(engine)),
                    adapter,
                    features,
                    reason,
                    None,
                )
            }
            Chosen::Cpu { backend, reason } => {
                let engine = Engine::new(backend, &files, config, &mut upload).map_err(js_error)?;
                let device = engine.backend().info().device;
                let threads = CpuThreads {
                    count: engine.backend().threads(),
                    fewer_reason: fewer_threads,
                };
                (
                    AnyEngine::Cpu(Box::new(engine)),
                    device,
                    Features::default(),
                    reason,
                    Some(threads),
                )
            }
        };
        let fallback_reason =
            (asked == Asked::Auto && engine.name() == "cpu").then(|| backend_reason.clone());
        let info = Info {
            model,
            source: loaded.origin,
            model_bytes: loaded.bytes.len(),
            backend: engine.name().into(),
            backend_reason,
            adapter,
            features,
            fallback_reason,
            kv_dtype,
            kv_bytes_per_token: engine.kv_bytes_per_token(),
            context,
            threads,
        };
        // The weights are on the backend now: only the tokenizer stays (the
        // file's bytes are freed when `loaded.bytes` and `files` go).
        let runtime = Runtime {
            engine,
            tokenizer: files.tokenizer,
        };
        Ok(Tandem {
            info,
            shared: Rc::new(Shared {
                runtime: RefCell::new(runtime),
                active: Cell::new(None),
                generated: RefCell::new(Vec::new()),
                finish: Cell::new(None),
            }),
        })
    }

    /// Starts generating after `prompt` and returns an async iterable of text
    /// pieces, one per engine step. `options`: `maxTokens` (128),
    /// `temperature` (0: greedy), `topP` (1), `seed` (0), and KV eviction
    /// (`kvBudget`, `kvEvict`, `kvSinks`, `kvRecent`: `eviction_option`). A
    /// generation still running is stopped.
    #[wasm_bindgen(unchecked_return_type = "AsyncIterable<string>")]
    pub fn generate(
        &self,
        prompt: &str,
        #[wasm_bindgen(unchecked_optional_param_type = "GenerateOptions")] options: Option<Object>,
    ) -> Result<JsValue, JsError> {
        let tokens = self.tokenizer(|t| t.encode(prompt, true))?;
        self.start(tokens, options)
    }

    /// Like `generate`, after a conversation: `messages` is the whole
    /// conversation so far (`[{ role, content }]`: "system", "user",
    /// "assistant"), rendered with the model's chat template (ChatML when it
    /// has none) the way `tandem chat` renders it, ending with the prompt for
    /// the assistant's reply. Nothing is kept between calls.
    #[wasm_bindgen(unchecked_return_type = "AsyncIterable<string>")]
    pub fn chat(
        &self,
        #[wasm_bindgen(unchecked_param_type = "ChatMessage[]")] messages: JsValue,
        #[wasm_bindgen(unchecked_optional_param_type = "GenerateOptions")] options: Option<Object>,
    ) -> Result<JsValue, JsError> {
        let messages = chat_messages(&messages)?;
        let tokens = self.tokenizer(|t| {
            let text = t.apply_chat_template(&messages, true)?;
            t.encode(&text, true)
        })?;
        self.start(tokens, options)
    }

    /// Stops the running generation: its iterator ends at its next step
    /// (after the step in flight, if any). Never fails.
    pub fn abort(&self) {
        self.shared.abort();
    }

    /// Why the latest generation ended: `"stop"` (an end-of-text token),
    /// `"length"` (`maxTokens` or the context's end), `"abort"`; `null`
    /// while it runs or before any.
    #[wasm_bindgen(js_name = finishReason, unchecked_return_type = "FinishReason | null")]
    pub fn finish_reason(&self) -> JsValue {
        self.shared
            .finish
            .get()
            .map_or(JsValue::NULL, |f| f.name().into())
    }

    /// Token ids generated by the latest generation.
    #[wasm_bindgen(js_name = generatedTokens)]
    pub fn generated_tokens(&self) -> Uint32Array {
        Uint32Array::from(self.shared.generated.borrow().as_slice())
    }

    /// `{ model, source, modelBytes, backend, backendReason, adapter,
    /// features: { shaderF16, subgroups, usesF16, usesSubgroups },
    /// fallbackReason, kvDtype, kvBytesPerToken, context, threads, threadsReason }`.
    #[wasm_bindgen(unchecked_return_type = "TandemInfo")]
    pub fn info(&self) -> Result<Object, JsError> {
        self.info.to_js()
    }
}

impl Tandem {
    /// Runs `f` on the model's tokenizer.
    fn tokenizer<T>(
        &self,
        f: impl FnOnce(&Tokenizer) -> tandem_core::Result<T>,
    ) -> Result<T, JsError> {
        let runtime = self.shared.runtime.try_borrow().map_err(|_| busy())?;
        f(&runtime.tokenizer).map_err(js_error)
    }

    /// Starts a generation after `prompt` (token ids), stopping the running one.
    fn start(&self, prompt: Vec<u32>, options: Option<Object>) -> Result<JsValue, JsError> {
        let options = options.unwrap_or_default();
        let max_tokens = number_option(&options, "maxTokens")?
            .map_or(DEFAULT_MAX_TOKENS, |n| n.max(0.0) as usize);
        let params = SamplingParams {
            temperature: number_option(&options, "temperature")?.unwrap_or(0.0) as f32,
            top_p: number_option(&options, "topP")?.unwrap_or(1.0) as f32,
            seed: number_option(&options, "seed")?.unwrap_or(0.0) as u64,
            ..SamplingParams::default()
        };
        let kv_eviction = eviction_option(&options, self.info.context)?;
        // A step in flight cannot be cut short: refuse rather than abort it.
        if self.shared.runtime.try_borrow_mut().is_err() {
            return Err(busy());
        }
        self.shared.abort();
        let mut runtime = self.shared.runtime.borrow_mut();
        let seq = runtime
            .start(prompt, params, max_tokens, kv_eviction)
            .map_err(js_error)?;
        self.shared.active.set(Some(seq));
        self.shared.generated.borrow_mut().clear();
        self.shared.finish.set(None);
        Ok(async_pieces(Generation {
            shared: Rc::downgrade(&self.shared),
            seq,
            decoder: Rc::new(RefCell::new(StreamDecoder::new())),
        }))
    }
}

/// A model file in wasm memory and what was parsed from it.
struct LoadedModel {
    files: ModelFiles,
    /// The file's bytes (the weights in `files` point into them).
    bytes: Arc<Bytes>,
    origin: Origin,
    cache_key: Option<String>,
}

/// Reads and parses the model. A cached copy that is incomplete or does not
/// parse is dropped from the cache and the model downloaded again.
async fn read_model(
    source: &JsValue,
    cache: Option<&str>,
    progress: &Progress,
) -> Result<LoadedModel, JsError> {
    let error = match read_and_parse(source, cache, true, progress).await {
        Ok(loaded) => return Ok(loaded),
        Err(error) => error,
    };
    let (Some(cache), Some(key)) = (cache, error.cached) else {
        return Err(JsError::new(&error.message));
    };
    warn(&format!(
        "tandem: the cached copy of {key} is bad ({}); downloading it again",
        error.message
    ));
    source::forget(cache, &key)
        .await
        .map_err(|e| JsError::new(&e))?;
    read_and_parse(source, Some(cache), false, progress)
        .await
        .map_err(|e| JsError::new(&e.message))
}

async fn read_and_parse(
    source: &JsValue,
    cache: Option<&str>,
    use_cached: bool,
    progress: &Progress,
) -> Result<LoadedModel, source::ReadError> {
    let model = source::read(source, cache, use_cached, progress).await?;
    let bytes = Arc::new(Bytes::Owned(model.bytes));
    let path = Path::new(&model.name);
    match GgufFile::parse(bytes.clone(), path).and_then(|file| model_from_gguf(file, path)) {
        Ok(files) => Ok(LoadedModel {
            files,
            bytes,
            origin: model.origin,
            cache_key: model.cache_key,
        }),
        Err(e) => Err(source::ReadError {
            message: e.to_string(),
            cached: model.cache_key.filter(|_| model.origin == Origin::Cache),
        }),
    }
}

/// One generation, as the async iterable's source: each `next()` runs one
/// engine step and resolves to the text it completed (possibly empty), or
/// `undefined` when the sequence is finished or stopped, or the engine freed.
/// It holds the engine weakly: `free()` on the engine releases the model at
/// once, not when the garbage collector gets to the finished iterators.
#[wasm_bindgen]
pub struct Generation {
    shared: Weak<Shared>,
    seq: SeqId,
    decoder: Rc<RefCell<StreamDecoder>>,
}

#[wasm_bindgen]
impl Generation {
    #[wasm_bindgen(unchecked_return_type = "Promise<string | undefined>")]
    pub fn next(&self) -> js_sys::Promise {
        let shared = self.shared.upgrade();
        let seq = self.seq;
        let decoder = self.decoder.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            let Some(shared) = shared else {
                return Ok(JsValue::UNDEFINED);
            };
            next_piece(&shared, seq, &decoder)
                .await
                .map_err(|e| JsValue::from(js_sys::Error::new(&e)))
        })
    }

    /// Ends this generation (a `break` out of `for await` calls it).
    pub fn stop(&self) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        if shared.active.get() == Some(self.seq) {
            shared.abort();
        }
    }
}

/// Runs engine steps until `seq` gets a token; returns its text, or
/// `undefined` once the sequence is finished or was stopped. The runtime
/// stays borrowed while the step's results download: a call that comes in
/// meanwhile gets the "busy" error instead of a half-done step.
#[allow(clippy::await_holding_refcell_ref)]
async fn next_piece(
    shared: &Shared,
    seq: SeqId,
    decoder: &RefCell<StreamDecoder>,
) -> Result<JsValue, String> {
    loop {
        if shared.active.get() != Some(seq) {
            return Ok(JsValue::UNDEFINED);
        }
        let mut runtime = shared
            .runtime
            .try_borrow_mut()
            .map_err(|_| busy_message())?;
        if runtime.is_finished(seq) {
            let rest = runtime.finish_text(&mut decoder.borrow_mut())?;
            runtime.remove(seq);
            shared.active.set(None);
            return Ok(rest.map_or(JsValue::UNDEFINED, JsValue::from));
        }
        let events = runtime.step().await.map_err(|e| e.to_string())?;
        if shared.active.get() != Some(seq) {
            // Aborted while the step ran.
            runtime.remove(seq);
            return Ok(JsValue::UNDEFINED);
        }
        let Some(event) = events.iter().find(|e| e.seq == seq) else {
            continue; // a prompt chunk: no token yet
        };
        let token = event.token;
        if let Some(reason) = event.finished {
            shared.finish.set(Some(reason.into()));
        }
        shared.generated.borrow_mut().push(token);
        let piece = runtime.push_token(&mut decoder.borrow_mut(), token)?;
        return Ok(JsValue::from(piece.unwrap_or_default()));
    }
}

fn js_error(e: tandem_core::Error) -> JsError {
    JsError::new(&e.to_string())
}

fn busy_message() -> String {
    "the engine is busy with a step of the running generation: await its piece before \
     asking for the next or starting another generation"
        .into()
}

fn busy() -> JsError {
    JsError::new(&busy_message())
}
