//! Which backend a load runs on, and why (`info().backendReason`).
//!
//! `"auto"` prefers WebGPU on a hardware adapter. A software adapter
//! (`GPUAdapterInfo.isFallbackAdapter`, or SwiftShader/llvmpipe/lavapipe in
//! its name) runs a model several times slower than the CPU backend in wasm
//! (SmolLM2-135M: 0.7 against 12 tokens/s), so `auto` takes the CPU there;
//! `"webgpu"` still gets it when asked for by name.

use js_sys::Reflect;
use wasm_bindgen::prelude::*;

use tandem_wgpu::{WgpuBackend, WgpuOptions};

#[wasm_bindgen(module = "/src/adapter.js")]
extern "C" {
    #[wasm_bindgen(js_name = probeAdapter)]
    async fn probe_adapter() -> JsValue;
}

/// The backend a load asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asked {
    Auto,
    WebGpu,
    Cpu,
}

impl Asked {
    pub fn parse(name: &str) -> Result<Asked, String> {
        match name {
            "auto" => Ok(Asked::Auto),
            "webgpu" => Ok(Asked::WebGpu),
            "cpu" => Ok(Asked::Cpu),
            other => Err(format!(
                "backend must be \"auto\", \"webgpu\" or \"cpu\", not {other:?}"
            )),
        }
    }
}

/// What the load runs on.
pub enum Chosen {
    WebGpu {
        backend: Box<WgpuBackend>,
        reason: String,
    },
    Cpu {
        reason: String,
    },
}

/// Opens the backend `asked` for; an error only when WebGPU was asked for by
/// name and cannot be opened.
pub async fn choose(asked: Asked) -> Result<Chosen, String> {
    let cpu = |reason: String| Ok(Chosen::Cpu { reason });
    match asked {
        Asked::Cpu => cpu("the CPU backend was asked for".into()),
        Asked::WebGpu => Ok(Chosen::WebGpu {
            backend: Box::new(open_webgpu().await?),
            reason: "WebGPU was asked for".into(),
        }),
        Asked::Auto => {
            let probe = probe_adapter().await;
            let field = |object: &JsValue, key: &str| {
                Reflect::get(object, &key.into()).unwrap_or(JsValue::UNDEFINED)
            };
            if field(&probe, "gpu").as_bool() != Some(true) {
                return cpu("this browser has no WebGPU (navigator.gpu is missing)".into());
            }
            let adapter = field(&probe, "adapter");
            if adapter.is_null() || adapter.is_undefined() {
                return cpu("the browser offers no WebGPU adapter".into());
            }
            let description = field(&adapter, "description")
                .as_string()
                .unwrap_or_default();
            if field(&adapter, "software").as_bool() == Some(true) {
                return cpu(software_reason(&description));
            }
            match open_webgpu().await {
                // wgpu's own reading of the adapter, in case the browser's info hid it.
                Ok(backend) if backend.adapter().software => {
                    cpu(software_reason(&backend.adapter().name))
                }
                Ok(backend) => Ok(Chosen::WebGpu {
                    backend: Box::new(backend),
                    reason: format!("a hardware WebGPU adapter ({description})"),
                }),
                Err(reason) => cpu(reason),
            }
        }
    }
}

fn software_reason(adapter: &str) -> String {
    format!(
        "WebGPU's adapter is a software rasterizer ({adapter}): the CPU backend in wasm is faster"
    )
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
