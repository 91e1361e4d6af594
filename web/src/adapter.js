// What the browser's WebGPU adapter is, read before Tandem opens a device
// (src/choose.rs decides on it): a software adapter (SwiftShader, llvmpipe,
// lavapipe) runs the model several times slower than the CPU backend in wasm.

/** Names a software rasterizer goes by in GPUAdapterInfo's text fields. */
const SOFTWARE = /swiftshader|llvmpipe|lavapipe|softpipe|software|\bwarp\b/i;

/**
 * `{ gpu: false }` without navigator.gpu, `{ gpu: true, adapter: null }`
 * without an adapter, else `{ gpu: true, adapter: { description, software,
 * softwareBy } }`: `softwareBy` says which field gave it away, or is null.
 */
export async function probeAdapter() {
  const gpu = globalThis.navigator?.gpu;
  if (!gpu) return { gpu: false, adapter: null };
  let adapter = null;
  try {
    adapter = await gpu.requestAdapter({ powerPreference: "high-performance" });
  } catch {
    adapter = null;
  }
  if (!adapter) return { gpu: true, adapter: null };
  // `info` is the current attribute; older browsers had requestAdapterInfo().
  const info = adapter.info ?? (await adapter.requestAdapterInfo?.()) ?? {};
  const fields = ["vendor", "architecture", "device", "description"]
    .map((key) => info[key])
    .filter((value) => typeof value === "string" && value !== "");
  const description = fields.join(" ") || "unnamed adapter";
  let softwareBy = null;
  if (info.isFallbackAdapter ?? adapter.isFallbackAdapter) {
    softwareBy = "isFallbackAdapter";
  } else if (fields.some((value) => SOFTWARE.test(value))) {
    softwareBy = "name";
  }
  return { gpu: true, adapter: { description, software: softwareBy !== null, softwareBy } };
}
