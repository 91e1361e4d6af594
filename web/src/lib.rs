//! Tandem in the browser: the `Tandem` class that JavaScript sees.
//!
//! ```js
//! const engine = await Tandem.load(url, { onProgress, backend: "auto" });
//! for await (const piece of engine.generate(prompt, { maxTokens, temperature, topP, seed })) { ... }
//! for await (const piece of engine.chat([{ role: "user", content }], { maxTokens })) { ... }
//! engine.abort(); engine.info();
//! ```
//!
//! The model's bytes stream into wasm memory (`source`: fetch, Cache API,
//! progress). The model runs on the browser's WebGPU (`tandem-wgpu`); where
//! `navigator.gpu` is missing or no adapter opens, on the CPU backend, single
//! threaded. Every engine step reads its tokens back with an async download
//! (blocking is not allowed on the browser's main thread), so each `next()`
//! of a generation is one `Engine::begin_step` / `finish_step` pair.
//! Errors become JavaScript exceptions; nothing panics across the boundary.

mod source;

use std::cell::{Cell, RefCell};
use std::path::Path;
use std::rc::{Rc, Weak};
use std::sync::Arc;

use js_sys::{Array, Function, Object, Reflect, Uint32Array};
use wasm_bindgen::prelude::*;

use tandem_core::backend::KvDtype;
use tandem_core::engine::{Engine, EngineConfig, ReadValues, Readback, TokenEvent};
use tandem_core::kv::SeqId;
use tandem_core::model::gguf::{model_from_gguf, GgufFile};
use tandem_core::model::{Bytes, ModelFiles};
use tandem_core::sched::SamplingParams;
use tandem_core::tokenizer::{ChatMessage, StreamDecoder, Tokenizer};
use tandem_core::Backend;
use tandem_cpu::CpuBackend;
use tandem_wgpu::{WgpuBackend, WgpuOptions};

use source::{Origin, Progress};

/// Tokens of context the KV cache holds (f32 K/V: SmolLM2-135M takes 90 MiB).
const CONTEXT_TOKENS: usize = 2048;
const DEFAULT_MAX_TOKENS: usize = 128;
/// The Cache API cache downloaded models go to unless `options.cache` names another.
const DEFAULT_CACHE: &str = "tandem-models-v1";

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
  /** "auto" (default): WebGPU, else the CPU backend in wasm. */
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
   * (per token, groups of 32) or "int4" (keys per channel over each KV
   * block, values per token), as `--kv-dtype` natively.
   */
  kvDtype?: "f32" | "f16" | "int8" | "int4";
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
}
export interface TandemInfo {
  model: string;
  /** Where the model's bytes came from. */
  source: "network" | "cache" | "caller";
  /** Size of the model file in bytes. */
  modelBytes: number;
  backend: "webgpu" | "cpu";
  adapter: string;
  features: { shaderF16: boolean; subgroups: boolean; usesF16: boolean; usesSubgroups: boolean };
  fallbackReason: string | null;
  kvDtype: "f32" | "f16" | "int8" | "int4";
  /** KV-cache bytes per token of context, all layers. */
  kvBytesPerToken: number;
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
}

#[wasm_bindgen]
impl Tandem {
    /// Loads a GGUF model from `source`: a URL (string or URL: fetched with
    /// a streamed body and kept in the Cache API), a Response, a Blob or
    /// File, an ArrayBuffer or a Uint8Array. `options.onProgress({ phase,
    /// done, total })` follows reading the bytes and uploading the weights;
    /// `options.backend` is `"auto"` (WebGPU, else the CPU), `"webgpu"` or
    /// `"cpu"`; `options.cache` is `true` (default), a cache name, or `false`;
    /// `options.kvDtype` is the KV cache's storage (`"f32"` by default).
    pub async fn load(
        #[wasm_bindgen(unchecked_param_type = "ModelSource")] source: JsValue,
        #[wasm_bindgen(unchecked_optional_param_type = "LoadOptions")] options: Option<Object>,
    ) -> Result<Tandem, JsError> {
        let options = options.unwrap_or_default();
        let choice = string_option(&options, "backend")?.unwrap_or_else(|| "auto".into());
        let cache = cache_option(&options)?;
        let kv_dtype = match string_option(&options, "kvDtype")? {
            Some(name) => name
                .parse::<KvDtype>()
                .map_err(|e| JsError::new(&format!("kvDtype: {e}")))?,
            None => KvDtype::F32,
        };
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
            kv_dtype,
            ..EngineConfig::default()
        }
        .with_capacity_tokens(context);

        let gpu = match choice.as_str() {
            "cpu" => Err("the CPU backend was asked for".to_string()),
            "auto" | "webgpu" => open_webgpu().await,
            other => {
                return Err(JsError::new(&format!(
                    "backend must be \"auto\", \"webgpu\" or \"cpu\", not {other:?}"
                )))
            }
        };
        let (engine, adapter, features, fallback_reason) = match gpu {
            Ok(backend) => {
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
                let engine = Engine::new(backend, &files, config, &mut upload).map_err(js_error)?;
                (AnyEngine::WebGpu(Box::new(engine)), adapter, features, None)
            }
            Err(reason) if choice == "webgpu" => return Err(JsError::new(&reason)),
            Err(reason) => {
                let engine = Engine::new(CpuBackend::new(1), &files, config, &mut upload)
                    .map_err(js_error)?;
                let device = engine.backend().info().device;
                (
                    AnyEngine::Cpu(Box::new(engine)),
                    device,
                    Features::default(),
                    Some(reason),
                )
            }
        };
        let info = Info {
            model,
            source: loaded.origin,
            model_bytes: loaded.bytes.len(),
            backend: engine.name().into(),
            adapter,
            features,
            fallback_reason,
            kv_dtype,
            kv_bytes_per_token: engine.kv_bytes_per_token(),
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
            }),
        })
    }

    /// Starts generating after `prompt` and returns an async iterable of text
    /// pieces, one per engine step. `options`: `maxTokens` (128),
    /// `temperature` (0: greedy), `topP` (1), `seed` (0). A generation still
    /// running is stopped.
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

    /// Stops the running generation (its iterator ends at its next step).
    pub fn abort(&self) -> Result<(), JsError> {
        if let Some(seq) = self.shared.active.take() {
            let mut runtime = self.shared.runtime.try_borrow_mut().map_err(|_| busy())?;
            runtime.remove(seq);
        }
        Ok(())
    }

    /// Token ids generated by the latest generation.
    #[wasm_bindgen(js_name = generatedTokens)]
    pub fn generated_tokens(&self) -> Uint32Array {
        Uint32Array::from(self.shared.generated.borrow().as_slice())
    }

    /// `{ model, source, modelBytes, backend, adapter, features: { shaderF16,
    /// subgroups, usesF16, usesSubgroups }, fallbackReason }`.
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
        self.abort()?;
        let mut runtime = self.shared.runtime.try_borrow_mut().map_err(|_| busy())?;
        let seq = runtime
            .start(prompt, params, max_tokens)
            .map_err(js_error)?;
        self.shared.active.set(Some(seq));
        self.shared.generated.borrow_mut().clear();
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

/// `[{ role, content }]` from JavaScript.
fn chat_messages(messages: &JsValue) -> Result<Vec<ChatMessage>, JsError> {
    let wrong = || {
        JsError::new(
            "messages must be a non-empty array of { role, content } objects \
             whose role and content are strings",
        )
    };
    if !Array::is_array(messages) {
        return Err(wrong());
    }
    let messages = Array::from(messages);
    if messages.length() == 0 {
        return Err(wrong());
    }
    messages
        .iter()
        .map(|m| {
            let field = |key: &str| {
                Reflect::get(&m, &key.into())
                    .ok()
                    .and_then(|v| v.as_string())
                    .ok_or_else(wrong)
            };
            Ok(ChatMessage::new(field("role")?, field("content")?))
        })
        .collect()
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
            shared.active.set(None);
            if let Ok(mut runtime) = shared.runtime.try_borrow_mut() {
                runtime.remove(self.seq);
            }
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
        let Some(token) = events.iter().find(|e| e.seq == seq).map(|e| e.token) else {
            continue; // a prompt chunk: no token yet
        };
        shared.generated.borrow_mut().push(token);
        let piece = runtime.push_token(&mut decoder.borrow_mut(), token)?;
        return Ok(JsValue::from(piece.unwrap_or_default()));
    }
}

/// The engine on whichever backend opened, and the model's tokenizer.
struct Runtime {
    engine: AnyEngine,
    tokenizer: Tokenizer,
}

enum AnyEngine {
    WebGpu(Box<Engine<WgpuBackend>>),
    Cpu(Box<Engine<CpuBackend>>),
}

impl AnyEngine {
    fn name(&self) -> &'static str {
        match self {
            AnyEngine::WebGpu(_) => "webgpu",
            AnyEngine::Cpu(_) => "cpu",
        }
    }

    fn kv_bytes_per_token(&self) -> usize {
        match self {
            AnyEngine::WebGpu(e) => e.kv_bytes_per_token(),
            AnyEngine::Cpu(e) => e.kv_bytes_per_token(),
        }
    }
}

impl Runtime {
    fn start(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        max_tokens: usize,
    ) -> tandem_core::Result<SeqId> {
        let stop = self.tokenizer.eos_tokens().to_vec();
        match &mut self.engine {
            AnyEngine::WebGpu(e) => e.add_request(prompt, params, max_tokens, stop),
            AnyEngine::Cpu(e) => e.add_request(prompt, params, max_tokens, stop),
        }
    }

    fn is_finished(&self, seq: SeqId) -> bool {
        match &self.engine {
            AnyEngine::WebGpu(e) => e.is_finished(seq),
            AnyEngine::Cpu(e) => e.is_finished(seq),
        }
    }

    fn remove(&mut self, seq: SeqId) {
        match &mut self.engine {
            AnyEngine::WebGpu(e) => e.remove(seq),
            AnyEngine::Cpu(e) => e.remove(seq),
        }
    }

    async fn step(&mut self) -> tandem_core::Result<Vec<TokenEvent>> {
        match &mut self.engine {
            AnyEngine::WebGpu(e) => step_without_blocking(e).await,
            AnyEngine::Cpu(e) => step_without_blocking(e).await,
        }
    }

    fn push_token(
        &self,
        decoder: &mut StreamDecoder,
        token: u32,
    ) -> Result<Option<String>, String> {
        decoder
            .push(&self.tokenizer, token)
            .map_err(|e| e.to_string())
    }

    fn finish_text(&self, decoder: &mut StreamDecoder) -> Result<Option<String>, String> {
        decoder.finish(&self.tokenizer).map_err(|e| e.to_string())
    }
}

/// One engine step whose results are read back without blocking.
async fn step_without_blocking<B: AsyncReadback>(
    engine: &mut Engine<B>,
) -> tandem_core::Result<Vec<TokenEvent>> {
    let pending = engine.begin_step()?;
    match engine.backend().read(pending.readback()).await {
        Ok(values) => Ok(engine.finish_step(pending, values)?),
        Err(e) => Err(engine.fail_step(pending, e).into()),
    }
}

/// Reading a step's results back from the device the way the browser allows.
trait AsyncReadback: Backend + Sized {
    async fn read(&self, readback: &Readback<Self>) -> tandem_core::Result<ReadValues>;
}

impl AsyncReadback for WgpuBackend {
    async fn read(&self, readback: &Readback<Self>) -> tandem_core::Result<ReadValues> {
        Ok(match readback {
            Readback::Nothing => ReadValues::Nothing,
            Readback::Logits { tensor, len } => {
                ReadValues::Logits(self.download_async(tensor, *len).await?)
            }
            Readback::TokenIds { ids, len } => {
                ReadValues::TokenIds(self.download_indices_async(ids, *len).await?)
            }
        })
    }
}

/// Host memory: the synchronous downloads are plain copies.
impl AsyncReadback for CpuBackend {
    async fn read(&self, readback: &Readback<Self>) -> tandem_core::Result<ReadValues> {
        Ok(match readback {
            Readback::Nothing => ReadValues::Nothing,
            Readback::Logits { tensor, len } => ReadValues::Logits(self.download(tensor, *len)?),
            Readback::TokenIds { ids, len } => {
                ReadValues::TokenIds(self.download_indices(ids, *len)?)
            }
        })
    }
}

/// Opens WebGPU, or says why it cannot be used.
async fn open_webgpu() -> Result<WgpuBackend, String> {
    let navigator = Reflect::get(&js_sys::global(), &"navigator".into()).unwrap_or_default();
    let has_gpu = !navigator.is_undefined()
        && Reflect::get(&navigator, &"gpu".into()).is_ok_and(|gpu| !gpu.is_undefined());
    if !has_gpu {
        return Err("this browser has no WebGPU (navigator.gpu is missing)".into());
    }
    WgpuBackend::new_async(WgpuOptions::default())
        .await
        .map_err(|e| format!("WebGPU could not be opened: {e}"))
}

/// What `Tandem.info()` returns.
struct Info {
    model: String,
    source: Origin,
    model_bytes: usize,
    backend: String,
    adapter: String,
    features: Features,
    fallback_reason: Option<String>,
    kv_dtype: KvDtype,
    kv_bytes_per_token: usize,
}

#[derive(Default)]
struct Features {
    shader_f16: bool,
    subgroups: bool,
    uses_f16: bool,
    uses_subgroups: bool,
}

impl Info {
    fn to_js(&self) -> Result<Object, JsError> {
        let features = Object::new();
        set(&features, "shaderF16", self.features.shader_f16.into())?;
        set(&features, "subgroups", self.features.subgroups.into())?;
        set(&features, "usesF16", self.features.uses_f16.into())?;
        set(
            &features,
            "usesSubgroups",
            self.features.uses_subgroups.into(),
        )?;
        let info = Object::new();
        set(&info, "model", self.model.as_str().into())?;
        set(&info, "source", self.source.as_str().into())?;
        set(&info, "modelBytes", (self.model_bytes as f64).into())?;
        set(&info, "backend", self.backend.as_str().into())?;
        set(&info, "adapter", self.adapter.as_str().into())?;
        set(&info, "features", features.into())?;
        let reason = self
            .fallback_reason
            .as_deref()
            .map_or(JsValue::NULL, JsValue::from);
        set(&info, "fallbackReason", reason)?;
        set(&info, "kvDtype", self.kv_dtype.name().into())?;
        set(
            &info,
            "kvBytesPerToken",
            (self.kv_bytes_per_token as f64).into(),
        )?;
        Ok(info)
    }
}

fn get(object: &Object, key: &str) -> Result<JsValue, JsError> {
    Reflect::get(object, &key.into())
        .map_err(|_| JsError::new(&format!("cannot read option {key}")))
}

fn set(object: &Object, key: &str, value: JsValue) -> Result<(), JsError> {
    Reflect::set(object, &key.into(), &value)
        .map(drop)
        .map_err(|_| JsError::new(&format!("cannot set {key}")))
}

fn number_option(options: &Object, key: &str) -> Result<Option<f64>, JsError> {
    let value = get(options, key)?;
    if value.is_undefined() || value.is_null() {
        return Ok(None);
    }
    match value.as_f64() {
        Some(n) if n.is_finite() => Ok(Some(n)),
        _ => Err(JsError::new(&format!(
            "option {key} must be a finite number"
        ))),
    }
}

/// `options.cache`: the cache's name, or `None` for no caching.
fn cache_option(options: &Object) -> Result<Option<String>, JsError> {
    let value = get(options, "cache")?;
    if value.is_undefined() || value.is_null() || value.as_bool() == Some(true) {
        return Ok(Some(DEFAULT_CACHE.into()));
    }
    if value.as_bool() == Some(false) {
        return Ok(None);
    }
    match value.as_string() {
        Some(name) if !name.is_empty() => Ok(Some(name)),
        _ => Err(JsError::new(
            "option cache must be true, false or the name of a cache",
        )),
    }
}

fn string_option(options: &Object, key: &str) -> Result<Option<String>, JsError> {
    let value = get(options, key)?;
    if value.is_undefined() || value.is_null() {
        return Ok(None);
    }
    value
        .as_string()
        .map(Some)
        .ok_or_else(|| JsError::new(&format!("option {key} must be a string")))
}

fn js_error(e: tandem_core::Error) -> JsError {
    JsError::new(&e.to_string())
}

fn busy_message() -> String {
    "the engine is busy with another step: await each piece before asking for the next".into()
}

fn busy() -> JsError {
    JsError::new(&busy_message())
}
