//! `tandem inspect`: what is in a model file, and which devices can run it.

use std::collections::BTreeMap;

use anyhow::Result;
use clap::Args;
use tandem_core::backend::KvDtype;
use tandem_core::kv::{KvPlan, KvPrecision, DEFAULT_BLOCK_SIZE};
use tandem_core::model::forward::Model;
use tandem_core::model::kv_calibration::calibrate_kv;
use tandem_core::model::ModelFiles;
use tandem_core::parallel::JobShape;
use tandem_quantize::dense::{linear_name, LINEARS};

use super::{KvCalibrationArgs, KvDtypeArg, ModelArgs};
use crate::backend_select::{BackendChoice, CpuIsaChoice};
use crate::model_path::{self, named};

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// GGUF file, Hugging Face directory, named model, `hf:ORG/REPO[:QUANT]`, or `default`.
    pub model: Option<String>,
    /// List every tensor, not just a summary per format.
    #[arg(long)]
    pub tensors: bool,
    /// List the compute devices each backend finds, instead of a model
    /// (under `mpirun`: those of every rank, printed by rank 0).
    #[arg(long)]
    pub devices: bool,
    /// List the named models (`--model NAME`): size, cached or not, licence.
    #[arg(long)]
    pub models: bool,
    /// KV cache element type whose size per token to report; `auto[:BITS]`
    /// calibrates a per-layer plan on the CPU and prints it with each
    /// layer's measured losses.
    #[arg(long, default_value = "f32", value_parser = super::kv_precision::parse_kv_dtype)]
    pub kv_dtype: KvDtypeArg,
    #[command(flatten)]
    pub kv_calibration: KvCalibrationArgs,
    /// Tokens per KV block the sizes and the calibration assume.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_BLOCK_SIZE, value_parser = super::kv_precision::parse_kv_block_size)]
    pub kv_block_size: usize,
    /// Show how `--tp N` would split the model: each rank's heads and FFN features.
    #[arg(long, value_name = "N")]
    pub tp: Option<usize>,
    /// Show how `--pp N` would split the model: each stage's layers.
    #[arg(long, value_name = "N")]
    pub pp: Option<usize>,
    /// Show how `--ep N` would place each MoE layer's experts.
    #[arg(long, value_name = "N")]
    pub ep: Option<usize>,
}

pub fn run(args: InspectArgs) -> Result<()> {
    if args.devices {
        return print_devices();
    }
    if args.models {
        return print_named_models();
    }
    let model_args = ModelArgs {
        model: args.model.clone(),
        backend: BackendChoice::Cpu,
        threads: 0,
        cpu_isa: CpuIsaChoice::Best,
        ctx: None,
        kv_dtype: args.kv_dtype.clone(),
        kv_calibration: args.kv_calibration.clone(),
        kv_block_size: args.kv_block_size,
        graph_batch: 0,
        unfused: false,
        tp: 1,
        pp: 1,
        ep: 1,
        micro_batches: None,
        device: None,
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
    if let Some(moe) = &c.moe {
        let (total, active) = c.parameter_counts();
        println!(
            "experts:        {} ({} per token, weights {}renormalised{})",
            moe.experts,
            moe.experts_per_token,
            if moe.normalize_weights { "" } else { "not " },
            moe.shared_ffn
                .map_or(String::new(), |w| format!(", shared expert of {w}"))
        );
        // Exact counts too: a tiny model's would all round to 0.1 M.
        println!(
            "active params:  {:.1} M per token of {:.1} M ({active} of {total})",
            active as f64 / 1e6,
            total as f64 / 1e6
        );
    }
    println!(
        "heads:          {} (KV heads {}, head dim {})",
        c.num_heads, c.num_kv_heads, c.head_dim
    );
    match &c.output_tokens {
        Some(tokens) => println!(
            "vocabulary:     {} (a draft's output head: {} of them)",
            c.vocab_size,
            tokens.len()
        ),
        None => println!("vocabulary:     {}", c.vocab_size),
    }
    if c.reads_hidden {
        println!(
            "draft input:    each token with its target's hidden state before it (an EAGLE head)"
        );
    }
    println!("context:        {}", c.max_context);
    println!(
        "rope:           {} of {} dims, {:?}",
        c.rotary_dim, c.head_dim, c.rope_style
    );
    for (first, last, layer) in c.layer_runs() {
        let attention = match layer.sliding_window {
            Some(w) => format!("sliding window {w}"),
            None => "global".to_string(),
        };
        println!(
            "layers {first:>3}-{last:<3}:  {attention} attention, rope theta {}, scaling {:?}",
            layer.rope.theta, layer.rope.scaling
        );
    }
    println!("rms eps:        {}", c.rms_eps);
    println!("tied embedding: {}", c.tied_embeddings);
    if c.qkv_bias {
        println!("qkv bias:       yes");
    }
    println!("block:          {:?}", c.block);
    let block_size = args.kv_block_size;
    let shape = c.kv_shape(block_size);
    let kv_bytes = |dtype: KvDtype| KvPlan::uniform(dtype, c.num_layers).bytes_per_token(shape);
    let chosen = match &args.kv_dtype {
        KvDtypeArg::Uniform(d) => KvPlan::uniform(*d, c.num_layers),
        KvDtypeArg::Plan(plan) => {
            plan.check_layers(c.num_layers)?;
            plan.clone()
        }
        KvDtypeArg::Auto { bits_per_element } => {
            calibrated_plan(&model_args, &files, *bits_per_element)?
        }
    };
    println!(
        "KV per token:   {} bytes ({}, {:.2} bits per element, blocks of {block_size} tokens)",
        chosen.bytes_per_token(shape),
        chosen
            .uniform_dtype()
            .map_or_else(|| format!("plan:{chosen}"), |d| d.to_string()),
        chosen.bits_per_element(shape),
    );
    let others: Vec<String> = KvDtype::ALL
        .into_iter()
        .filter(|&d| Some(d) != chosen.uniform_dtype())
        .map(|d| format!("{d} {}", kv_bytes(d)))
        .collect();
    println!("                (other KV dtypes: {})", others.join(", "));
    if args.tp.is_some() || args.pp.is_some() || args.ep.is_some() {
        let shape = JobShape::new(
            args.tp.unwrap_or(1),
            args.pp.unwrap_or(1),
            args.ep.unwrap_or(1),
        );
        let flags = shape.flags();
        for line in shape.describe(&files)? {
            println!("{flags}: {line}");
        }
    }

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
    print_layer_formats(&files);
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

/// The storage format of each layer's linears, consecutive layers alike on
/// one line: the per-layer plan of a quantized model.
fn print_layer_formats(files: &tandem_core::model::ModelFiles) {
    let describe = |layer: usize| -> String {
        let formats: Vec<&str> = LINEARS
            .iter()
            .map(|s| {
                files
                    .tensors
                    .info(&linear_name(layer, s))
                    .map_or("-", |t| t.format.name())
            })
            .collect();
        if formats.iter().all(|f| *f == formats[0]) {
            formats[0].to_string()
        } else {
            let parts: Vec<String> = LINEARS
                .iter()
                .zip(&formats)
                .map(|(s, f)| format!("{s} {f}"))
                .collect();
            parts.join(", ")
        }
    };
    println!("layer formats:");
    let layers = files.config.num_layers;
    let mut start = 0;
    while start < layers {
        let d = describe(start);
        let mut end = start;
        while end + 1 < layers && describe(end + 1) == d {
            end += 1;
        }
        let range = if end > start {
            format!("{start}-{end}")
        } else {
            start.to_string()
        };
        println!("  {range:>7}  {d}");
        start = end + 1;
    }
}

fn print_named_models() -> Result<()> {
    let cache = model_path::cache_dir();
    println!(
        "named models (--model NAME), cached in {}:",
        cache.display()
    );
    println!(
        "  {:14} {:>10}  {:10}  {:40}  LICENCE",
        "NAME", "SIZE", "STATUS", "FILE"
    );
    for m in named::table()? {
        let status = if cache.join(&m.file).is_file() {
            "cached"
        } else {
            "not cached"
        };
        let name = if m.name == named::DEFAULT_MODEL {
            format!("{} *", m.name)
        } else {
            m.name.clone()
        };
        println!(
            "  {name:14} {:>7.1} MB  {status:10}  {:40}  {}",
            m.bytes as f64 / 1e6,
            m.file,
            m.licence
        );
    }
    println!("  (* the default)");
    println!("from the Hugging Face hub: --model hf:ORG/REPO[:QUANT_OR_FILE]");
    Ok(())
}

/// This process's devices, or under `mpirun` every rank's: each rank
/// sends its lines to the others in turn, and rank 0 prints them.
fn print_devices() -> Result<()> {
    let lines = device_lines();
    let Some(world) = crate::parallel::launched_world()? else {
        lines.iter().for_each(|l| println!("{l}"));
        return Ok(());
    };
    let local = crate::parallel::local_rank();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let mine = format!(
        "host {}, local rank {local} (default --device {local})\n{}",
        host.trim(),
        lines.join("\n")
    );
    for root in 0..world.size() {
        let mut bytes = match root == world.rank() {
            true => mine.clone().into_bytes(),
            false => Vec::new(),
        };
        world.broadcast_bytes(&mut bytes, root)?;
        if world.rank() == 0 {
            for line in String::from_utf8_lossy(&bytes).lines() {
                println!("rank {root}: {line}");
            }
        }
    }
    Ok(())
}

/// One line per device of each backend this build has.
fn device_lines() -> Vec<String> {
    use tandem_core::Backend;
    let info = tandem_cpu::CpuBackend::new(0).info();
    let mut lines = vec![format!("{}: {}", info.name, info.device)];
    #[cfg(feature = "wgpu")]
    lines.extend(
        tandem_wgpu::list_adapters()
            .into_iter()
            .map(|a| format!("wgpu: {a}")),
    );
    #[cfg(feature = "cuda")]
    match tandem_cuda::list_devices() {
        Ok(devices) if devices.is_empty() => lines.push("cuda: driver present, no devices".into()),
        Ok(devices) => lines.extend(devices.into_iter().map(|d| format!("cuda: {d}"))),
        Err(e) => lines.push(format!("cuda: {e}")),
    }
    lines
}

/// `--kv-dtype auto`: calibrates on the CPU, prints every layer's losses
/// and choice, and returns the plan.
fn calibrated_plan(args: &ModelArgs, files: &ModelFiles, bits: f64) -> Result<KvPlan> {
    let KvPrecision::Auto(auto) = args.kv_precision(files)? else {
        anyhow::bail!("--kv-dtype {} is not a calibrated plan", args.kv_dtype);
    };
    let cpu = tandem_cpu::CpuBackend::new(args.threads);
    let model = Model::load(&cpu, files, &mut |_, _| {})?;
    let started = std::time::Instant::now();
    let calibration = calibrate_kv(&model, &cpu, &auto.calibration, args.kv_block_size, bits)?;
    println!(
        "KV calibration: {} tokens, {} passes, {:.1} s; mean KL (nats) of the output from the f16 cache's",
        auto.calibration.len(),
        calibration.passes,
        started.elapsed().as_secs_f64()
    );
    println!(
        "  each layer alone quantized, every other at f16: int8 keys and values; keys at int4 / int2 \
         (int8 values); what values at int4 / int2 add to int8 ones:"
    );
    let s = &calibration.sensitivity;
    for (layer, dtypes) in calibration.chosen.layers().iter().enumerate() {
        let (k, v) = (s.keys[layer], s.values[layer]);
        println!(
            "    layer {layer:>3}: {:.5}; keys {:.5} / {:.5}; values {:+.5} / {:+.5} -> {}/{}",
            k[0], k[1], k[2], v[1], v[2], dtypes.keys, dtypes.values
        );
    }
    println!("  uniform pairs within {bits} bits per element:");
    for (pair, kl) in &calibration.uniform {
        println!("    {}/{}: {kl:.5}", pair.keys, pair.values);
    }
    let base = calibration.base;
    println!(
        "  planned {}: KL {:.5}, the best uniform pair ({}/{}) {:.5}: {} kept",
        calibration.chosen,
        calibration.chosen_kl,
        base.keys,
        base.values,
        calibration.base_kl,
        if calibration.plan == calibration.chosen {
            "the plan"
        } else {
            "the uniform pair"
        }
    );
    let plan = calibration.plan;
    Ok(plan)
}
