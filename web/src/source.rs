//! Where a model's bytes come from: the source `Tandem.load` was given (a URL,
//! fetched and kept in the Cache API; a Response; a Blob or File; bytes), read
//! chunk by chunk straight into one wasm-side buffer, preallocated when the
//! length is known. JavaScript holds one chunk at a time, never the whole
//! file. `source.js` does the fetching and the Cache API calls; a download is
//! cached only after it arrived whole and parsed as a model (`store`).

use js_sys::{Function, Object, Reflect, Uint8Array};
use wasm_bindgen::prelude::*;

#[wasm_bindgen(module = "/src/source.js")]
extern "C" {
    #[wasm_bindgen(js_name = openSource, catch)]
    async fn open_source(
        source: &JsValue,
        cache_name: Option<String>,
        use_cached: bool,
    ) -> Result<JsValue, JsValue>;

    #[wasm_bindgen(js_name = storeInCache, catch)]
    async fn store_in_cache(
        cache_name: &str,
        url: &str,
        memory: JsValue,
        ptr: usize,
        len: usize,
    ) -> Result<JsValue, JsValue>;

    #[wasm_bindgen(js_name = forgetCached, catch)]
    async fn forget_cached(cache_name: &str, url: &str) -> Result<JsValue, JsValue>;

    /// A stream's chunks: `next()` gives a Uint8Array, valid until the next
    /// call, or null at the end.
    type Chunks;

    #[wasm_bindgen(catch)]
    fn chunks(stream: &JsValue) -> Result<Chunks, JsValue>;

    #[wasm_bindgen(method, catch)]
    async fn next(this: &Chunks) -> Result<JsValue, JsValue>;

    #[wasm_bindgen(method)]
    fn cancel(this: &Chunks);
}

/// Where the bytes came from (`info().source`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Downloaded from a URL.
    Network,
    /// A copy of that download in the browser's cache.
    Cache,
    /// A Response, Blob, File or bytes the caller handed in.
    Caller,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Network => "network",
            Origin::Cache => "cache",
            Origin::Caller => "caller",
        }
    }

    /// The `phase` progress reports while reading from this origin.
    fn phase(self) -> &'static str {
        match self {
            Origin::Network => "download",
            Origin::Cache => "cache",
            Origin::Caller => "read",
        }
    }
}

/// A model file in wasm memory.
pub struct ModelBytes {
    pub bytes: Vec<u8>,
    pub origin: Origin,
    /// The URL or file name, for error messages.
    pub name: String,
    /// The absolute URL when the bytes came from, or may be stored in, the cache.
    pub cache_key: Option<String>,
}

/// `options.onProgress`, called as `onProgress({ phase, done, total })`.
pub struct Progress(Option<Function>);

impl Progress {
    pub fn new(callback: Option<Function>) -> Self {
        Progress(callback)
    }

    /// `total` is `null` when unknown (a download without Content-Length).
    pub fn report(&self, phase: &str, done: usize, total: Option<usize>) {
        let Some(callback) = &self.0 else { return };
        let event = Object::new();
        let total = total.map_or(JsValue::NULL, |t| JsValue::from(t as f64));
        let _ = Reflect::set(&event, &"phase".into(), &phase.into());
        let _ = Reflect::set(&event, &"done".into(), &JsValue::from(done as f64));
        let _ = Reflect::set(&event, &"total".into(), &total);
        // A failing progress callback must not stop the load.
        let _ = callback.call1(&JsValue::NULL, &event);
    }
}

/// Why a source could not be read.
pub struct ReadError {
    pub message: String,
    /// The cache key when the bad bytes came from the cache (drop that copy).
    pub cached: Option<String>,
}

impl From<String> for ReadError {
    fn from(message: String) -> Self {
        ReadError {
            message,
            cached: None,
        }
    }
}

/// Opens `source` and reads it whole into wasm memory. With `cache_name`, a
/// URL is looked up in that cache first (unless `use_cached` is false).
pub async fn read(
    source: &JsValue,
    cache_name: Option<&str>,
    use_cached: bool,
    progress: &Progress,
) -> Result<ModelBytes, ReadError> {
    let opened = open_source(source, cache_name.map(str::to_string), use_cached)
        .await
        .map_err(message)?;
    let field = |key: &str| Reflect::get(&opened, &key.into()).unwrap_or_default();
    let origin = match field("kind").as_string().as_deref() {
        Some("network") => Origin::Network,
        Some("cache") => Origin::Cache,
        _ => Origin::Caller,
    };
    let name = field("name")
        .as_string()
        .unwrap_or_else(|| "model.gguf".into());
    let cache_key = field("cacheKey").as_string();
    let total = field("total").as_f64().map(|t| t as usize);
    let bytes = match field("bytes").dyn_into::<Uint8Array>() {
        Ok(bytes) => {
            let bytes = bytes.to_vec();
            progress.report(origin.phase(), bytes.len(), Some(bytes.len()));
            bytes
        }
        Err(_) => read_stream(&field("stream"), total, origin.phase(), progress)
            .await
            .map_err(|e| ReadError {
                message: format!("{name}: {e}"),
                cached: cache_key.clone().filter(|_| origin == Origin::Cache),
            })?,
    };
    Ok(ModelBytes {
        bytes,
        origin,
        name,
        cache_key,
    })
}

/// Reads a ReadableStream of Uint8Array chunks into one buffer, allocated
/// once when `total` is known; the stream must end at exactly `total` bytes.
async fn read_stream(
    stream: &JsValue,
    total: Option<usize>,
    phase: &str,
    progress: &Progress,
) -> Result<Vec<u8>, String> {
    let mut buffer = Vec::new();
    if let Some(total) = total {
        buffer
            .try_reserve_exact(total)
            .map_err(|_| format!("{total} bytes do not fit in wasm memory"))?;
    }
    let reader = chunks(stream).map_err(|e| format!("cannot read the body ({})", message(e)))?;
    progress.report(phase, 0, total);
    loop {
        let chunk = reader
            .next()
            .await
            .map_err(|e| format!("the download failed ({})", message(e)))?;
        if chunk.is_null() {
            break;
        }
        let chunk: Uint8Array = chunk
            .dyn_into()
            .map_err(|_| "the stream gave something other than bytes")?;
        let start = buffer.len();
        let end = start + chunk.length() as usize;
        if total.is_some_and(|total| end > total) {
            reader.cancel();
            return Err(format!(
                "more bytes arrived than the announced {}",
                total.unwrap_or_default()
            ));
        }
        buffer
            .try_reserve(end - start)
            .map_err(|_| format!("{end} bytes do not fit in wasm memory"))?;
        buffer.resize(end, 0);
        chunk.copy_to(&mut buffer[start..]);
        progress.report(phase, end, total);
    }
    match total {
        Some(total) if buffer.len() != total => Err(format!(
            "the download ended after {} of {total} bytes",
            buffer.len()
        )),
        _ => Ok(buffer),
    }
}

/// Stores `bytes` in the cache as the copy of `key`; streamed from wasm
/// memory, one chunk at a time.
pub async fn store(cache_name: &str, key: &str, bytes: &[u8]) -> Result<(), String> {
    store_in_cache(
        cache_name,
        key,
        wasm_bindgen::memory(),
        bytes.as_ptr() as usize,
        bytes.len(),
    )
    .await
    .map(drop)
    .map_err(message)
}

/// Removes a cached copy that turned out incomplete or not a model.
pub async fn forget(cache_name: &str, key: &str) -> Result<(), String> {
    forget_cached(cache_name, key)
        .await
        .map(drop)
        .map_err(message)
}

/// The message of a JavaScript exception.
pub fn message(error: JsValue) -> String {
    match error.dyn_ref::<js_sys::Error>() {
        Some(e) => String::from(e.message()),
        None => error.as_string().unwrap_or_else(|| format!("{error:?}")),
    }
}
