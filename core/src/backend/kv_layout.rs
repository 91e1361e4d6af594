//! The paged KV cache's element types and the shape of one layer's storage,
//! which every backend allocates and the quantized layouts of
//! [`crate::kv::quant`] describe.

use crate::{Error, Result};

/// Element type of the paged KV cache. INT8, INT4 and INT2 store codes
/// with per-token, per-head, per-group scales and zero points, except INT4
/// and INT2 keys, which are quantized per channel over each block; their
/// block layouts are documented in [`crate::kv::quant`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum KvDtype {
    #[default]
    F32,
    F16,
    Int8,
    Int4,
    Int2,
}

impl KvDtype {
    /// Every dtype, in the order the CLI lists them.
    pub const ALL: [KvDtype; 5] = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Int8,
        KvDtype::Int4,
        KvDtype::Int2,
    ];

    /// Name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Int8 => "int8",
            KvDtype::Int4 => "int4",
            KvDtype::Int2 => "int2",
        }
    }

    /// Bits per code of a quantized dtype; `None` for F32 and F16.
    pub fn code_bits(self) -> Option<usize> {
        match self {
            KvDtype::F32 | KvDtype::F16 => None,
            KvDtype::Int8 => Some(8),
            KvDtype::Int4 => Some(4),
            KvDtype::Int2 => Some(2),
        }
    }

    /// Bytes of one token's V row of `kv_heads * head_dim` elements (and of
    /// its K row, except for INT4, whose keys are quantized per block).
    fn row_bytes(self, kv_heads: usize, head_dim: usize) -> usize {
        match crate::kv::quant::KvQuantLayout::new(self, kv_heads, head_dim) {
            Some(quant) => 4 * quant.slot_words(),
            None if self == KvDtype::F16 => 2 * kv_heads * head_dim,
            None => 4 * kv_heads * head_dim,
        }
    }

    /// Bytes of the keys of one KV block of `block_size` tokens.
    pub fn key_block_bytes(self, kv_heads: usize, head_dim: usize, block_size: usize) -> usize {
        match crate::kv::quant::KeyBlockLayout::new(self, kv_heads, head_dim, block_size) {
            Some(keys) => 4 * keys.block_words(),
            None => block_size * self.row_bytes(kv_heads, head_dim),
        }
    }

    /// Bytes of the values of one KV block of `block_size` tokens.
    pub fn value_block_bytes(self, kv_heads: usize, head_dim: usize, block_size: usize) -> usize {
        block_size * self.row_bytes(kv_heads, head_dim)
    }

    /// Bytes of K plus V per token in one layer, with block-wide
    /// parameters (INT4 keys) spread over the block's tokens, rounded up.
    pub fn bytes_per_token(self, kv_heads: usize, head_dim: usize, block_size: usize) -> usize {
        (self.key_block_bytes(kv_heads, head_dim, block_size)
            + self.value_block_bytes(kv_heads, head_dim, block_size))
        .div_ceil(block_size.max(1))
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = crate::Error;

    fn from_str(s: &str) -> crate::Result<Self> {
        KvDtype::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<_> = KvDtype::ALL.iter().map(|d| d.name()).collect();
                crate::Error::InvalidRequest(format!(
                    "unknown KV dtype `{s}` (expected one of {})",
                    names.join(", ")
                ))
            })
    }
}

/// Shape of one layer's paged KV storage. Both K and V are
/// `[num_blocks, block_size]` slots; a slot holds one token's K (or V) for
/// all heads: `kv_heads * head_dim` elements (F32, F16) as one contiguous
/// row at slot `block * block_size + offset`, or the quantized slot of
/// [`crate::kv::quant`] (INT8, INT4, INT2). INT4 keys are stored per block
/// ([`crate::kv::quant::KeyBlockLayout`]).
///
/// Keys and values have a dtype each (`--kv-dtype auto` chooses them
/// apart): the same float dtype, or two quantized ones
/// ([`KvCacheLayout::check`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheLayout {
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub keys: KvDtype,
    pub values: KvDtype,
}

impl KvCacheLayout {
    /// Keys and values of one dtype.
    pub fn uniform(
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> Self {
        KvCacheLayout {
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            keys: dtype,
            values: dtype,
        }
    }

    /// Refuses a pair of dtypes no backend stores: keys and values are one
    /// float dtype, or both quantized (each at its own bits). Every
    /// backend's kernels read a float cache through one element type and a
    /// quantized one through words, so a float/quantized pair would need a
    /// kernel variant per pair for no gain (INT8 is as good as F16).
    pub fn check(&self) -> Result<()> {
        let quantized = (self.keys.code_bits(), self.values.code_bits());
        match quantized {
            (Some(_), Some(_)) => Ok(()),
            _ if self.keys == self.values => Ok(()),
            _ => Err(Error::InvalidRequest(format!(
                "KV keys {} with values {}: a layer's keys and values are one float dtype \
                 or both quantized (int8, int4, int2)",
                self.keys, self.values
            ))),
        }
    }

    pub fn row_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// The quantized slot layout of the values, `None` for float caches.
    pub fn value_quant(&self) -> Option<crate::kv::quant::KvQuantLayout> {
        crate::kv::quant::KvQuantLayout::new(self.values, self.kv_heads, self.head_dim)
    }

    /// The quantized slot layout of INT8 keys, `None` for float keys and
    /// for INT4 and INT2 keys, which are stored per block ([`Self::key_blocks`]).
    pub fn key_quant(&self) -> Option<crate::kv::quant::KvQuantLayout> {
        match self.key_blocks() {
            Some(_) => None,
            None => crate::kv::quant::KvQuantLayout::new(self.keys, self.kv_heads, self.head_dim),
        }
    }

    /// The per-channel block layout of INT4 and INT2 keys, `None` for other dtypes.
    pub fn key_blocks(&self) -> Option<crate::kv::quant::KeyBlockLayout> {
        crate::kv::quant::KeyBlockLayout::new(
            self.keys,
            self.kv_heads,
            self.head_dim,
            self.block_size,
        )
    }

    /// Bytes of one block's keys.
    pub fn key_block_bytes(&self) -> usize {
        self.keys
            .key_block_bytes(self.kv_heads, self.head_dim, self.block_size)
    }

    /// Bytes of one block's values.
    pub fn value_block_bytes(&self) -> usize {
        self.values
            .value_block_bytes(self.kv_heads, self.head_dim, self.block_size)
    }

    /// Bytes of K plus V for one token in one layer (block parameters spread
    /// over the block, rounded up).
    pub fn bytes_per_token(&self) -> usize {
        (self.key_block_bytes() + self.value_block_bytes()).div_ceil(self.block_size.max(1))
    }
}
