//! Which backend a load runs on, and why (`info().backendReason`).
//!
//! `"auto"` takes the CPU backend in wasm where WebGPU is missing or does
//! not open; otherwise it times both backends on the same short piece of
//! decoding (`probe`) and takes the faster. A software adapter
//! (`GPUAdapterInfo.isFallbackAdapter`, or SwiftShader/llvmpipe/lavapipe in
//! its name) is named as such in the reason: it runs a model many times
//! slower than the CPU backend (SmolLM2-135M: 0.2-0.7 against 6-12
//! tokens/s), and the probe shows it. `"webgpu"` still gets any adapter when
//! asked for by name.

use js_sys::Reflect;
use wasm_bindgen::prelude::*;

use tandem_cpu::CpuBackend;
use tandem_wgpu::{WgpuBackend, WgpuOptions};

use crate::probe::{described, median, ProbeProduct, ROUNDS};

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
        backend: CpuBackend,
        reason: String,
    },
}

/// Opens the backend `asked` for (`cpu_backend` is the CPU backend, ready);
/// an error only when WebGPU was asked for by name and cannot be opened.
pub async fn choose(asked: Asked, cpu_backend: CpuBackend) -> Result<Chosen, String> {
    match asked {
        Asked::Cpu => Ok(Chosen::Cpu {
            backend: cpu_backend,
            reason: "the CPU backend was asked for".into(),
        }),
        Asked::WebGpu => Ok(Chosen::WebGpu {
            backend: Box::new(open_webgpu().await?),
            reason: "WebGPU was asked for".into(),
        }),
        Asked::Auto => auto(cpu_backend).await,
    }
}

/// `auto`: the CPU without WebGPU, else the faster of the two.
async fn auto(cpu_backend: CpuBackend) -> Result<Chosen, String> {
    let cpu = |backend, reason| Ok(Chosen::Cpu { backend, reason });
    let probe = probe_adapter().await;
    let field = |object: &JsValue, key: &str| {
        Reflect::get(object, &key.into()).unwrap_or(JsValue::UNDEFINED)
    };
    if field(&probe, "gpu").as_bool() != Some(true) {
        return cpu(
            cpu_backend,
            "this browser has no WebGPU (navigator.gpu is missing)".into(),
        );
    }
    let adapter = field(&probe, "adapter");
    if adapter.is_null() || adapter.is_undefined() {
        return cpu(cpu_backend, "the browser offers no WebGPU adapter".into());
    }
    let description = field(&adapter, "description")
        .as_string()
        .unwrap_or_default();
    let webgpu = match open_webgpu().await {
        Ok(backend) => backend,
        Err(reason) => return cpu(cpu_backend, reason),
    };
    let adapter = if field(&adapter, "software").as_bool() == Some(true) {
        software_adapter(&description)
    } else if webgpu.adapter().software {
        // wgpu's own reading of the adapter, in case the browser's info hid it.
        software_adapter(&webgpu.adapter().name)
    } else {
        format!("a hardware WebGPU adapter ({description})")
    };
    let (webgpu_ms, cpu_ms) = match time_both(&webgpu, &cpu_backend).await {
        Ok(timed) => timed,
        Err(Failed::WebGpu(e)) => {
            return cpu(cpu_backend, format!("{adapter} failed the speed test: {e}"))
        }
        Err(Failed::Cpu(e)) => {
            return Ok(Chosen::WebGpu {
                backend: Box::new(webgpu),
                reason: format!("{adapter}; the CPU backend failed the speed test: {e}"),
            })
        }
    };
    let measured = described(webgpu_ms, cpu_ms);
    if cpu_ms < webgpu_ms {
        cpu(
            cpu_backend,
            format!("{adapter}: the CPU backend in wasm is faster ({measured})"),
        )
    } else {
        Ok(Chosen::WebGpu {
            backend: Box::new(webgpu),
            reason: format!("{adapter}: faster than the CPU backend in wasm ({measured})"),
        })
    }
}

/// Which backend's speed test failed.
enum Failed {
    WebGpu(tandem_core::Error),
    Cpu(tandem_core::Error),
}

/// Milliseconds per probe product on WebGPU and on the CPU: the medians of
/// [`ROUNDS`] rounds each, the two backends taking turns.
async fn time_both(webgpu: &WgpuBackend, cpu: &CpuBackend) -> Result<(f64, f64), Failed> {
    let mut on_webgpu = ProbeProduct::new(webgpu).await.map_err(Failed::WebGpu)?;
    let mut on_cpu = ProbeProduct::new(cpu).await.map_err(Failed::Cpu)?;
    let (mut webgpu_ms, mut cpu_ms) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        webgpu_ms.push(on_webgpu.time_round().await.map_err(Failed::WebGpu)?);
        cpu_ms.push(on_cpu.time_round().await.map_err(Failed::Cpu)?);
    }
    Ok((median(&mut webgpu_ms), median(&mut cpu_ms)))
}

fn software_adapter(name: &str) -> String {
    format!("WebGPU's adapter is a software rasterizer ({name})")
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
