//! `tandem inspect`: what is in a model file, and which devices can run it.

use std::collections::BTreeMap;

use anyhow::Result;
use clap::Args;

use super::ModelArgs;
use crate::backend_select::BackendChoice;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// GGUF file, Hugging Face directory, or `default`.
    pub model: Option<String>,
    /// List every tensor, not just a summary per format.
    #[arg(long)]
    pub tensors: bool,
    /// List the compute devices each backend finds, instead of a model.
    #[arg(long)]
    pub devices: bool,
}

pub fn run(args: InspectArgs) -> Result<()> {
    if args.devices {
        print_devices();
        return Ok(());
    }
    let model_args = ModelArgs {
        model: args.model.clone(),
        backend: BackendChoice::Cpu,
        threads: 0,
        ctx: None,
    };
    let files = model_args.load_files()?;
    let c = &files.config;
    println!("model:          {}", files.path.display());
    println!("architecture:   {}", c.arch);
    let params: usize = files.tensors.tensors().iter().map(|t| t.elems()).sum();
    println!("parameters:     {:.1} M", params as f64 / 1e6);
    println!("layers:         {}", c.num_layers);
    println!("hidden size:    {}", c.hidden_size);
    println!("ffn size:       {}", c.intermediate_size);
    println!(
        "heads:          {} (KV heads {}, head dim {})",
        c.num_heads, c.num_kv_heads, c.head_dim
    );
    println!("vocabulary:     {}", c.vocab_size);
    println!("context:        {}", c.max_context);
    println!(
        "rope:           theta {}, {} of {} dims, {:?}, scaling {:?}",
        c.rope_theta, c.rotary_dim, c.head_dim, c.rope_style, c.rope_scaling
    );
    println!("rms eps:        {}", c.rms_eps);
    println!("tied embedding: {}", c.tied_embeddings);
    if c.qkv_bias {
        println!("qkv bias:       yes");
    }
    if let Some(w) = c.sliding_window {
        println!("sliding window: {w}");
    }
    let kv_bytes = c.num_layers * 2 * c.kv_dim() * 4;
    println!("KV per token:   {kv_bytes} bytes (f32)");

    let mut by_format: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for t in files.tensors.tensors() {
        let e = by_format.entry(t.format.name()).or_default();
        e.0 += 1;
        e.1 += t.len;
    }
    println!(
        "tensors:        {} ({:.1} MiB)",
        files.tensors.tensors().len(),
        files.tensors.total_bytes() as f64 / (1 << 20) as f64
    );
    for (format, (count, bytes)) in &by_format {
        println!(
            "  {format:6} {count:5} tensors {:10.2} MiB",
            *bytes as f64 / (1 << 20) as f64
        );
    }
    if args.tensors {
        for t in files.tensors.tensors() {
            println!(
                "  {:40} {:6} {:?} {} bytes",
                t.name,
                t.format.name(),
                t.shape,
                t.len
            );
        }
    }
    println!("tokenizer:      {}", files.tokenizer.describe());
    match files.tokenizer.chat_template() {
        Some(t) => println!("chat template:\n{t}"),
        None => println!("chat template:  none (ChatML is used)"),
    }
    if !files.metadata.is_empty() {
        println!("metadata:");
        for (k, v) in &files.metadata {
            println!("  {k} = {v}");
        }
    }
    Ok(())
}

fn print_devices() {
    use tandem_core::Backend;
    let info = tandem_cpu::CpuBackend::new(0).info();
    println!("{}: {}", info.name, info.device);
    #[cfg(feature = "wgpu")]
    for adapter in tandem_wgpu::list_adapters() {
        println!("wgpu: {adapter}");
    }
    #[cfg(feature = "cuda")]
    match tandem_cuda::list_devices() {
        Ok(devices) if devices.is_empty() => println!("cuda: driver present, no devices"),
        Ok(devices) => {
            for d in devices {
                println!("cuda: {d}");
            }
        }
        Err(e) => println!("cuda: {e}"),
    }
}
