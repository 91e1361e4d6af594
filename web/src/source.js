// Where a model's bytes come from, for Tandem.load (src/source.rs reads them):
// a URL (fetched, and kept in the Cache API), a Response, a Blob or File, or
// bytes. Streams are handed over whole and read chunk by chunk on the Rust
// side, straight into wasm memory: no complete copy of the file is ever held
// here.

/** Bytes per chunk when a model is read, and when it is written to the cache. */
const CHUNK = 1 << 20;

/**
 * Opens `source`. Returns `{ kind, name, stream, bytes, total, cacheKey }`:
 * `kind` is "network", "cache" or "caller" (a Response, Blob or bytes the
 * caller handed in); `stream` a ReadableStream of Uint8Array chunks, or
 * `bytes` (a Uint8Array) for bytes; `total` the byte count when known, else
 * null; `cacheKey` the absolute URL when the model came from, or may go to,
 * the cache named `cacheName` (null: no caching). `useCached: false` skips
 * the cache lookup (a cached copy turned out bad).
 */
export async function openSource(source, cacheName, useCached) {
  if (typeof source === "string" || source instanceof URL) {
    const url = new URL(source, globalThis.location?.href).href;
    // The Cache API exists only in secure contexts (https, localhost).
    const cache = cacheName && globalThis.caches ? await caches.open(cacheName) : null;
    const cached = useCached ? await cache?.match(url) : undefined;
    if (cached) return fromResponse(cached, "cache", url, url);
    let response;
    try {
      response = await fetch(url);
    } catch (e) {
      throw new Error(`${url}: the download failed (${e.message})`);
    }
    if (!response.ok) {
      throw new Error(`${url}: HTTP ${response.status} ${response.statusText}`.trim());
    }
    return fromResponse(response, "network", url, cache ? url : null);
  }
  if (source instanceof Response) return fromResponse(source, "caller", source.url || "model.gguf", null);
  if (source instanceof Blob) {
    const name = source.name ?? "model.gguf";
    return { kind: "caller", name, stream: source.stream(), bytes: null, total: source.size, cacheKey: null };
  }
  if (source instanceof ArrayBuffer || source instanceof Uint8Array) {
    const bytes = source instanceof Uint8Array ? source : new Uint8Array(source);
    return { kind: "caller", name: "model.gguf", stream: null, bytes, total: bytes.length, cacheKey: null };
  }
  throw new TypeError(
    "Tandem.load: the model must be a URL (string or URL), a Response, a Blob or File, an ArrayBuffer or a Uint8Array",
  );
}

/**
 * Reads `stream` a chunk at a time: `next()` resolves to a Uint8Array, valid
 * until the next call, or to null at the end. A byte stream (fetch, Cache
 * API, Blob) is read into one reused buffer, so reading leaves no garbage
 * chunks behind for the collector.
 */
export function chunks(stream) {
  let byob = null;
  try {
    byob = stream.getReader({ mode: "byob" });
  } catch {
    const reader = stream.getReader();
    return {
      next: async () => { const { done, value } = await reader.read(); return done ? null : value; },
      cancel: () => reader.cancel().catch(() => {}),
    };
  }
  let buffer = new ArrayBuffer(CHUNK);
  return {
    async next() {
      const { done, value } = await byob.read(new Uint8Array(buffer));
      if (done) return null;
      buffer = value.buffer;
      return value;
    },
    cancel: () => byob.cancel().catch(() => {}),
  };
}

function fromResponse(response, kind, name, cacheKey) {
  if (!response.body) throw new Error(`${name}: the response has no body`);
  // A compressed response's Content-Length counts compressed bytes, not the file's.
  const encoding = response.headers.get("content-encoding");
  const length = response.headers.get("content-length");
  const total = length !== null && (!encoding || encoding === "identity") ? Number(length) : null;
  return { kind, name, stream: response.body, bytes: null, total, cacheKey };
}

/**
 * Stores `len` bytes of wasm `memory` at `ptr` as the cached copy of `url`.
 * The body streams from wasm memory a chunk at a time (a fresh view per
 * chunk: growing memory replaces its buffer), so no second whole copy exists.
 */
export async function storeInCache(cacheName, url, memory, ptr, len) {
  const cache = await caches.open(cacheName);
  let offset = 0;
  const body = new ReadableStream({
    pull(controller) {
      const n = Math.min(CHUNK, len - offset);
      controller.enqueue(new Uint8Array(memory.buffer, ptr + offset, n).slice());
      offset += n;
      if (offset === len) controller.close();
    },
  }, { highWaterMark: 0 });
  await cache.put(url, new Response(body, {
    headers: { "content-type": "application/octet-stream", "content-length": String(len) },
  }));
}

/** Removes the cached copy of `url` (it was incomplete or not a model). */
export async function forgetCached(cacheName, url) {
  await (await caches.open(cacheName)).delete(url);
}
