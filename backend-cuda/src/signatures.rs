//! Every kernel the backend launches, in one table: its file, its entry
//! point's name and its parameter list. The launch code pushes arguments
//! only through the functions this table generates (one per row, typed
//! after the row's parameters), so a launch cannot pass other arguments
//! than the table says: a wrong count, a scalar of the wrong type or a
//! scalar for a pointer does not compile (two pointers swapped still do:
//! pointers are one kind). The table is checked against the `extern "C" __global__`
//! declarations of `kernels/*.cu` by the unit tests (`signatures/tests.rs`),
//! which expand the files' macros as NVRTC would, for every unit the
//! backend compiles, on any machine.
//!
//! Entry names are patterns: `{stem}` is the weight format's stem
//! (`format_stem`: `f32`, `q4_k`, `int4_g64`, ...), `{variant}` the rest
//! that the launch site picks (a matmul's `gemv_t4`, `tiled`, ...; the KV
//! cache's `f32` or `f16`).

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaViewMut, LaunchArgs, LaunchConfig, PushKernelArg,
};
use tandem_core::kernels::matmul_kernel_name;
use tandem_core::quant::WeightFormat;
use tandem_core::Result;

use crate::backend::{format_stem, AttentionShape, CudaBackend, QuantAttentionShape};
use crate::backend_error;

#[cfg(test)]
mod preprocess;
#[cfg(test)]
mod tests;

/// A kernel parameter, as the calling convention sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Any device pointer (`const float*`, `u8*`, ...); null for an absent buffer.
    Ptr,
    I32,
    U32,
    U64,
    F32,
    /// A struct passed by value: the kernels' type name and the Rust
    /// mirror's size in bytes.
    Struct {
        name: &'static str,
        bytes: usize,
    },
}

/// Where a kernel's entry point is compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum File {
    /// `kernels/NAME.cu`, one unit.
    Whole(&'static str),
    /// `kernels/NAME.cu`, one unit per weight format (`sources::format_unit`).
    PerFormat(&'static str),
    /// The weight format's `kernels/matmul_FMT.cu` (`matmul_kernel_name`).
    Matmul,
}

/// One row of the table.
#[derive(Debug)]
pub(crate) struct Signature {
    /// The generated launch function's name.
    pub name: &'static str,
    pub file: File,
    /// The entry point's name, `{stem}` and `{variant}` to fill in.
    pub entry: &'static str,
    /// The parameters, as the launch function's types say (read by the tests).
    #[cfg_attr(not(test), allow(dead_code))]
    pub args: &'static [Kind],
}

/// Which entry point of a signature a launch wants.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Which<'a> {
    /// The weight format: picks a per-format unit or the `matmul_FMT.cu`
    /// file, and fills `{stem}`.
    pub format: Option<WeightFormat>,
    /// Fills `{variant}`.
    pub variant: Option<&'a str>,
}

impl<'a> Which<'a> {
    /// A signature without a format or a variant.
    pub const ONE: Which<'static> = Which {
        format: None,
        variant: None,
    };

    pub fn format(format: WeightFormat) -> Self {
        Which {
            format: Some(format),
            variant: None,
        }
    }

    pub fn variant(variant: &'a str) -> Self {
        Which {
            format: None,
            variant: Some(variant),
        }
    }

    pub fn format_variant(format: WeightFormat, variant: &'a str) -> Self {
        Which {
            format: Some(format),
            variant: Some(variant),
        }
    }
}

/// A signature's entry point, named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Resolved {
    /// The kernel file (`sources::KERNEL_FILES`).
    pub file: &'static str,
    /// The format stem of a per-format unit.
    pub unit: Option<&'static str>,
    pub entry: String,
}

impl Signature {
    /// The file, unit and entry point `which` names. A format or variant
    /// the signature has no use for, or one it needs and lacks, is an error.
    pub(crate) fn resolve(&self, which: Which<'_>) -> Result<Resolved> {
        let needs_format = !matches!(self.file, File::Whole(_)) || self.entry.contains("{stem}");
        let needs_variant = self.entry.contains("{variant}");
        if needs_format != which.format.is_some() || needs_variant != which.variant.is_some() {
            return Err(backend_error(format!(
                "kernel {} ({}): launched with {which:?}, it takes {} format and {} variant",
                self.name,
                self.entry,
                if needs_format { "a" } else { "no" },
                if needs_variant { "a" } else { "no" },
            )));
        }
        let stem = which.format.map(format_stem);
        let (file, unit) = match (self.file, which.format) {
            (File::Whole(file), _) => (file, None),
            (File::PerFormat(file), _) => (file, stem),
            (File::Matmul, Some(format)) => (matmul_kernel_name(format), None),
            (File::Matmul, None) => return Err(backend_error("a matmul file needs a format")),
        };
        let mut entry = self.entry.to_string();
        if let Some(stem) = stem {
            entry = entry.replace("{stem}", stem);
        }
        if let Some(variant) = which.variant {
            entry = entry.replace("{variant}", variant);
        }
        Ok(Resolved { file, unit, entry })
    }
}

/// A device pointer argument: a buffer, a view of one, or `None` for null.
pub(crate) trait KernelPtr<'a> {
    fn push<'l>(self, args: &mut LaunchArgs<'l>)
    where
        'a: 'l;
}

impl<'a, T> KernelPtr<'a> for &'a CudaSlice<T> {
    fn push<'l>(self, args: &mut LaunchArgs<'l>)
    where
        'a: 'l,
    {
        args.arg(self);
    }
}

impl<'a, T> KernelPtr<'a> for &'a mut CudaSlice<T> {
    fn push<'l>(self, args: &mut LaunchArgs<'l>)
    where
        'a: 'l,
    {
        args.arg(self);
    }
}

impl<'a, 'v: 'a, T> KernelPtr<'a> for &'a mut CudaViewMut<'v, T> {
    fn push<'l>(self, args: &mut LaunchArgs<'l>)
    where
        'a: 'l,
    {
        args.arg(self);
    }
}

/// The null pointer an absent optional buffer is passed as.
static NULL_DEVICE_PTR: u64 = 0;

impl<'a, P: KernelPtr<'a>> KernelPtr<'a> for Option<P> {
    fn push<'l>(self, args: &mut LaunchArgs<'l>)
    where
        'a: 'l,
    {
        match self {
            Some(ptr) => ptr.push(args),
            None => {
                args.arg(&NULL_DEVICE_PTR);
            }
        }
    }
}

/// The Rust type of a parameter of kind `$kind`.
macro_rules! param_type {
    ($lt:lifetime, ptr) => { impl KernelPtr<$lt> };
    ($lt:lifetime, i32) => { &$lt i32 };
    ($lt:lifetime, u32) => { &$lt u32 };
    ($lt:lifetime, u64) => { &$lt u64 };
    ($lt:lifetime, f32) => { &$lt f32 };
    ($lt:lifetime, $struct:ident) => { &$lt $struct };
}

macro_rules! param_kind {
    (ptr) => {
        Kind::Ptr
    };
    (i32) => {
        Kind::I32
    };
    (u32) => {
        Kind::U32
    };
    (u64) => {
        Kind::U64
    };
    (f32) => {
        Kind::F32
    };
    ($struct:ident) => {
        Kind::Struct {
            name: stringify!($struct),
            bytes: std::mem::size_of::<$struct>(),
        }
    };
}

macro_rules! push_arg {
    ($args:ident, ptr, $value:ident) => {
        $value.push(&mut $args)
    };
    ($args:ident, $kind:ident, $value:ident) => {
        $args.arg($value)
    };
}

/// The table: per row a `SIGNATURE_NAME` constant (upper case) in
/// [`SIGNATURES`] and the launch function `name(backend, which, cfg, args...)`.
macro_rules! signatures {
    ($(
        $(#[$doc:meta])*
        $name:ident / $constant:ident: $file:expr, $entry:literal
            ($($param:ident: $kind:ident),* $(,)?);
    )*) => {
        $(
            pub(crate) const $constant: Signature = Signature {
                name: stringify!($name),
                file: $file,
                entry: $entry,
                args: &[$(param_kind!($kind)),*],
            };

            $(#[$doc])*
            #[allow(clippy::too_many_arguments)]
            pub(crate) fn $name<'a>(
                backend: &CudaBackend,
                which: Which<'_>,
                cfg: LaunchConfig,
                $($param: param_type!('a, $kind)),*
            ) -> Result<()> {
                let (func, entry): (CudaFunction, String) =
                    backend.kernel(&$constant, which, &cfg)?;
                let mut args = backend.stream().launch_builder(&func);
                $(push_arg!(args, $kind, $param);)*
                backend.launch(&entry, &mut args, cfg)
            }
        )*

        /// Every row, in table order.
        #[cfg_attr(not(test), allow(dead_code))]
        pub(crate) const SIGNATURES: &[Signature] = &[$($constant),*];
    };
}

use File::{Matmul, PerFormat, Whole};

signatures! {
    embedding / EMBEDDING: Whole("embedding"), "embedding"
        (table: ptr, fmt: i32, row_bytes: u64, vocab: u32, tokens: ptr, dim: u32, out: ptr);
    rms_norm / RMS_NORM: Whole("rms_norm"), "rms_norm"
        (x: ptr, weight: ptr, weight_fmt: i32, dim: u32, eps: f32, out: ptr);
    rms_norm_residual / RMS_NORM_RESIDUAL: Whole("rms_norm_residual"), "rms_norm_residual"
        (residual: ptr, delta: ptr, weight: ptr, weight_fmt: i32, dim: u32, eps: f32, out: ptr);

    /// The plain matmul; `{variant}` from `matmul_variant`.
    matmul / MATMUL: Matmul, "matmul_{stem}_{variant}"
        (w: ptr, x: ptr, bias: ptr, bias_fmt: i32, out: ptr, tokens: u32, n: u32, cols: u32);
    /// The bias after a cuBLAS GEMM (F16, BF16).
    matmul_add_bias / MATMUL_ADD_BIAS: Matmul, "matmul_{stem}_add_bias"
        (out: ptr, bias: ptr, bias_fmt: i32, rows: u32, n: u32);
    matmul_f16_split_x / MATMUL_F16_SPLIT_X: Whole("matmul_f16"), "matmul_f16_split_x"
        (x: ptr, hi: ptr, lo: ptr, len: u64);
    matmul_bf16_split_x / MATMUL_BF16_SPLIT_X: Whole("matmul_bf16"), "matmul_bf16_split_x"
        (x: ptr, hi: ptr, lo: ptr, len: u64);

    /// `{variant}` from `matmul_variant`; outputs 1 and 2 null when absent.
    matmul_rms_norm / MATMUL_RMS_NORM:
        PerFormat("matmul_rms_norm"), "matmul_rms_norm_{stem}_{variant}"
        (w: ptr, x: ptr, norm: ptr, norm_fmt: i32, eps: f32, bias: ptr, bias_fmt: i32, out0: ptr,
         out1: ptr, out2: ptr, end0: u32, end1: u32, tokens: u32, n: u32, cols: u32);
    matmul_rms_norm_f16_split_x / MATMUL_RMS_NORM_F16_SPLIT_X:
        PerFormat("matmul_rms_norm"), "matmul_rms_norm_f16_split_x"
        (x: ptr, norm: ptr, norm_fmt: i32, eps: f32, cols: u32, hi: ptr, lo: ptr);
    matmul_rms_norm_bf16_split_x / MATMUL_RMS_NORM_BF16_SPLIT_X:
        PerFormat("matmul_rms_norm"), "matmul_rms_norm_bf16_split_x"
        (x: ptr, norm: ptr, norm_fmt: i32, eps: f32, cols: u32, hi: ptr, lo: ptr);
    matmul_rms_norm_add_bias / MATMUL_RMS_NORM_ADD_BIAS:
        PerFormat("matmul_rms_norm"), "matmul_rms_norm_add_bias"
        (out: ptr, bias: ptr, bias_fmt: i32, rows: u32, width: u32, start: u32);

    /// `{variant}` from `matmul_variant`.
    matmul_glu / MATMUL_GLU: PerFormat("matmul_glu"), "matmul_glu_{stem}_{variant}"
        (w: ptr, x: ptr, norm: ptr, norm_fmt: i32, eps: f32, act: i32, out: ptr, tokens: u32,
         n: u32, cols: u32);
    matmul_glu_gate / MATMUL_GLU_GATE: PerFormat("matmul_glu"), "matmul_glu_gate"
        (out: ptr, up: ptr, len: u64, act: i32);
    /// `{variant}` from `matmul_variant`.
    matmul_residual / MATMUL_RESIDUAL:
        PerFormat("matmul_residual"), "matmul_residual_{stem}_{variant}"
        (w: ptr, x: ptr, out: ptr, tokens: u32, n: u32, cols: u32);
    /// `{variant}` from `mlp_variant`.
    mlp_residual / MLP_RESIDUAL: PerFormat("mlp_residual"), "mlp_residual_{stem}_{variant}"
        (gate_up: ptr, down: ptr, residual: ptr, norm: ptr, norm_fmt: i32, eps: f32, act: i32,
         partials: ptr, counter: ptr, tokens: u32, dim: u32, f: u32);

    rope / ROPE: Whole("rope"), "rope"
        (x: ptr, positions: ptr, inv_freq: ptr, rows: u32, heads: u32, head_dim: u32,
         rotary_dim: u32, style: i32);

    /// `{variant}` from `kv_variant`.
    paged_kv_write / PAGED_KV_WRITE: Whole("paged_kv_write"), "paged_kv_write_{variant}"
        (k: ptr, v: ptr, slots: ptr, rows: u32, width: u32, num_slots: u32, k_cache: ptr,
         v_cache: ptr);
    paged_kv_write_quant / PAGED_KV_WRITE_QUANT:
        Whole("paged_kv_write_quant"), "paged_kv_write_quant"
        (k: ptr, v: ptr, slots: ptr, rows: u32, kv_heads: u32, head_dim: u32, groups_per_head: u32,
         num_slots: u32, key_slot_words: u32, key_bits: u32, value_slot_words: u32, value_bits: u32,
         keys: u32, k_cache: ptr, v_cache: ptr);
    paged_kv_write_int4_keys / PAGED_KV_WRITE_INT4_KEYS:
        Whole("paged_kv_write_int4_keys"), "paged_kv_write_int4_keys"
        (k: ptr, slots: ptr, rows: u32, channels: u32, block_size: u32, num_slots: u32, bits: u32,
         k_cache: ptr);

    /// `{variant}` from `kv_variant`.
    paged_attention_decode / PAGED_ATTENTION_DECODE:
        Whole("paged_attention"), "paged_attention_decode_{variant}"
        (q: ptr, k_cache: ptr, v_cache: ptr, row_seq: ptr, positions: ptr, block_tables: ptr,
         shape: AttentionShape, split_keys: u32, partial: ptr, out: ptr);
    paged_attention_reduce / PAGED_ATTENTION_REDUCE:
        Whole("paged_attention"), "paged_attention_reduce"
        (partial: ptr, heads: u32, head_dim: u32, splits: u32, out: ptr);
    /// `{variant}` from `kv_variant`.
    paged_attention_prefill / PAGED_ATTENTION_PREFILL:
        Whole("paged_attention"), "paged_attention_prefill_{variant}"
        (q: ptr, k_cache: ptr, v_cache: ptr, row_seq: ptr, positions: ptr, block_tables: ptr,
         shape: AttentionShape, out: ptr);
    /// `{variant}` from `kv_variant`.
    paged_attention_scores / PAGED_ATTENTION_SCORES:
        Whole("paged_attention"), "paged_attention_scores_{variant}"
        (q: ptr, k_cache: ptr, row_seq: ptr, positions: ptr, block_tables: ptr,
         shape: AttentionShape, scores: ptr);
    paged_attention_quant / PAGED_ATTENTION_QUANT:
        Whole("paged_attention_quant"), "paged_attention_quant"
        (q: ptr, k_cache: ptr, v_cache: ptr, row_seq: ptr, positions: ptr, block_tables: ptr,
         shape: QuantAttentionShape, out: ptr);
    paged_attention_quant_scores / PAGED_ATTENTION_QUANT_SCORES:
        Whole("paged_attention_quant"), "paged_attention_quant_scores"
        (q: ptr, k_cache: ptr, row_seq: ptr, positions: ptr, block_tables: ptr,
         shape: QuantAttentionShape, scores: ptr);

    swiglu / SWIGLU: Whole("swiglu"), "swiglu"
        (gate: ptr, up: ptr, len: u64, out: ptr);
    geglu / GEGLU: Whole("geglu"), "geglu"
        (gate: ptr, up: ptr, len: u64, out: ptr);
    scale / SCALE: Whole("scale"), "scale"
        (x: ptr, len: u64, factor: f32);
    gather_rows / GATHER_ROWS: Whole("gather_rows"), "gather_rows"
        (x: ptr, rows: ptr, width: u32, out: ptr);
    moe_route / MOE_ROUTE: Whole("moe_route"), "moe_route"
        (logits: ptr, rows: u32, experts: u32, k: u32, normalize: u32, shared_gate: u32, ids: ptr,
         weights: ptr);
    moe_combine / MOE_COMBINE: Whole("moe_combine"), "moe_combine"
        (y: ptr, rows: ptr, ids: ptr, weights: ptr, width: u32, expert: u32, slots: u32, out: ptr);
    argmax / ARGMAX: Whole("argmax"), "argmax"
        (x: ptr, width: u32, out: ptr);
    kv_key_bounds / KV_KEY_BOUNDS: Whole("kv_key_bounds"), "kv_key_bounds"
        (k: ptr, slots: ptr, rows: u32, channels: u32, head_dim: u32, block_size: u32,
         num_slots: u32, bounds: ptr);
    select_kv_blocks / SELECT_KV_BLOCKS: Whole("select_kv_blocks"), "select_kv_blocks"
        (q: ptr, row_seq: ptr, positions: ptr, tables: ptr, bounds: ptr, rows: u32, heads: u32,
         kv_heads: u32, head_dim: u32, block_size: u32, max_blocks: u32, top: u32, sinks: u32,
         recent: u32, scratch: ptr, out: ptr);
}
