//! Per-layer KV precision: which dtype each layer's keys and values are
//! stored at (`--kv-dtype auto[:BITS]`), and the planner that picks it.
//!
//! A [`KvPlan`] names, per layer, a dtype for the keys and one for the
//! values. `--kv-dtype int4` is the uniform plan; `--kv-dtype auto:BITS`
//! measures how much each layer's keys and values at each candidate dtype
//! move the model's output (`model::kv_calibration`) and
//! [`choose_plan`] keeps the plan of least total loss whose storage stays
//! within BITS per element. A plan is written and read as text
//! (`int8/int4,int4/int2*3,...`: keys/values per layer, `*N` repeating), so
//! a calibrated plan can be passed back with `--kv-dtype plan:...`.
//!
//! Each layer takes one of the quantized pairs (INT8, INT4 or INT2 for its
//! keys and for its values, chosen apart) or stays in floats: a layer's
//! keys and values are one float dtype or both quantized
//! ([`KvCacheLayout::check`]), so a float layer is F16 on both sides. INT8
//! matches F16 on SmolLM2 (+0.03% perplexity) but not on Qwen2.5 (+1.7%),
//! where a budget above INT8's buys its most sensitive layers back.

use std::fmt;

use crate::backend::{KvCacheLayout, KvDtype};
use crate::{Error, Result};

/// The dtypes of one layer's keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerKvDtypes {
    pub keys: KvDtype,
    pub values: KvDtype,
}

impl LayerKvDtypes {
    pub fn uniform(dtype: KvDtype) -> Self {
        LayerKvDtypes {
            keys: dtype,
            values: dtype,
        }
    }
}

/// The storage of every layer's K and V.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPlan {
    layers: Vec<LayerKvDtypes>,
}

/// How the engine stores its KV cache: one dtype, a given plan, or a plan
/// it calibrates once the model is loaded.
#[derive(Clone, Debug, PartialEq)]
pub enum KvPrecision {
    Uniform(KvDtype),
    Plan(KvPlan),
    Auto(AutoKvPlan),
}

/// What `--kv-dtype auto[:BITS]` calibrates with.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoKvPlan {
    /// Storage bits per cached element (scales and zero points included),
    /// averaged over every layer's keys and values.
    pub bits_per_element: f64,
    /// The calibration text's tokens (kept apart from any evaluation text).
    pub calibration: Vec<u32>,
}

/// Bits per element `auto` aims at unless told: between INT4 keys with
/// INT2 values (4.5 on SmolLM2's shape) and uniform INT4 (5.5).
pub const DEFAULT_AUTO_BITS: f64 = 4.5;

/// The quantized dtypes a plan chooses from, keys and values apart,
/// cheapest last; the first is the calibration's reference.
pub const PLAN_CANDIDATES: [KvDtype; 3] = [KvDtype::Int8, KvDtype::Int4, KvDtype::Int2];

/// The dtype of a layer a plan keeps in floats, keys and values alike.
pub const PLAN_FLOAT: KvDtype = KvDtype::F16;

/// Key/value pairs of different dtypes, one of each kind of mix (slots of
/// other bits, INT4's key blocks with other values): what the kernel tests
/// of every backend run beside the uniform dtypes.
pub const MIXED_KV_PAIRS: [(KvDtype, KvDtype); 3] = [
    (KvDtype::Int8, KvDtype::Int2),
    (KvDtype::Int4, KvDtype::Int8),
    (KvDtype::Int2, KvDtype::Int4),
];

/// How much the model's output moves when one layer alone is quantized,
/// every other staying at [`PLAN_FLOAT`] (`model::kv_calibration`):
/// `keys[layer][c]` with its keys at `PLAN_CANDIDATES[c]` and its values at
/// INT8, `values[layer][c]` what its values at `PLAN_CANDIDATES[c]` add to
/// INT8 values (0 for INT8 itself; negative where they measure better), and
/// `float[layer]` the loss of the layer at [`PLAN_FLOAT`] (0 when measured
/// against F16).
#[derive(Clone, Debug, PartialEq)]
pub struct KvSensitivity {
    pub keys: Vec<[f64; 3]>,
    pub values: Vec<[f64; 3]>,
    pub float: Vec<f64>,
}

impl KvSensitivity {
    /// Layer `layer`'s choices with their losses, taken as additive over
    /// its keys and values: every quantized pair, then the float layer.
    pub fn options(&self, layer: usize) -> Vec<(LayerKvDtypes, f64)> {
        let mut options = Vec::with_capacity(PLAN_CANDIDATES.len().pow(2) + 1);
        for (k, &keys) in PLAN_CANDIDATES.iter().enumerate() {
            for (v, &values) in PLAN_CANDIDATES.iter().enumerate() {
                let loss = self.keys[layer][k] + self.values[layer][v];
                options.push((LayerKvDtypes { keys, values }, loss));
            }
        }
        options.push((LayerKvDtypes::uniform(PLAN_FLOAT), self.float[layer]));
        options
    }
}

impl From<KvDtype> for KvPrecision {
    fn from(dtype: KvDtype) -> Self {
        KvPrecision::Uniform(dtype)
    }
}

impl Default for KvPrecision {
    fn default() -> Self {
        KvPrecision::Uniform(KvDtype::default())
    }
}

impl KvPrecision {
    /// The one dtype of a uniform precision (what a draft model's cache
    /// takes), INT8 for a plan.
    pub fn representative_dtype(&self) -> KvDtype {
        match self {
            KvPrecision::Uniform(d) => *d,
            KvPrecision::Plan(p) => p.uniform_dtype().unwrap_or(KvDtype::Int8),
            KvPrecision::Auto(_) => KvDtype::Int8,
        }
    }
}

impl fmt::Display for KvPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvPrecision::Uniform(d) => write!(f, "{d}"),
            KvPrecision::Plan(p) => write!(f, "plan:{p}"),
            KvPrecision::Auto(a) => write!(f, "auto:{}", a.bits_per_element),
        }
    }
}

impl KvPlan {
    pub fn uniform(dtype: KvDtype, num_layers: usize) -> Self {
        KvPlan::uniform_pair(LayerKvDtypes::uniform(dtype), num_layers)
    }

    /// Every layer at `dtypes` (a quantized pair or one float dtype).
    pub fn uniform_pair(dtypes: LayerKvDtypes, num_layers: usize) -> Self {
        KvPlan {
            layers: vec![dtypes; num_layers],
        }
    }

    /// A plan of the given layers; each layer's pair must be storable.
    pub fn new(layers: Vec<LayerKvDtypes>) -> Result<Self> {
        for (i, l) in layers.iter().enumerate() {
            KvCacheLayout {
                keys: l.keys,
                values: l.values,
                ..KvCacheLayout::uniform(0, 1, 1, 1, l.keys)
            }
            .check()
            .map_err(|e| Error::InvalidRequest(format!("KV plan layer {i}: {e}")))?;
        }
        Ok(KvPlan { layers })
    }

    pub fn layers(&self) -> &[LayerKvDtypes] {
        &self.layers
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The dtype of every key and value, when there is one.
    pub fn uniform_dtype(&self) -> Option<KvDtype> {
        let first = self.layers.first()?.keys;
        self.layers
            .iter()
            .all(|l| l.keys == first && l.values == first)
            .then_some(first)
    }

    /// Refuses a plan for a model of another depth.
    pub fn check_layers(&self, num_layers: usize) -> Result<()> {
        if self.layers.len() == num_layers {
            return Ok(());
        }
        Err(Error::InvalidRequest(format!(
            "the KV plan names {} layers but the model has {num_layers}",
            self.layers.len()
        )))
    }

    /// Layer `layer`'s cache layout.
    pub fn layout(&self, layer: usize, shape: KvShape, num_blocks: usize) -> KvCacheLayout {
        let l = self.layers[layer];
        KvCacheLayout {
            keys: l.keys,
            values: l.values,
            ..KvCacheLayout::uniform(
                num_blocks,
                shape.block_size,
                shape.kv_heads,
                shape.head_dim,
                l.keys,
            )
        }
    }

    /// Bytes of K plus V per token over all layers (block parameters spread
    /// over the block).
    pub fn bytes_per_token(&self, shape: KvShape) -> usize {
        self.block_bytes(shape).div_ceil(shape.block_size.max(1))
    }

    /// Storage bits per cached element, keys and values of every layer.
    pub fn bits_per_element(&self, shape: KvShape) -> f64 {
        let elements = 2 * self.layers.len() * shape.kv_heads * shape.head_dim;
        8.0 * self.block_bytes(shape) as f64 / (shape.block_size * elements).max(1) as f64
    }

    /// Whether the plan stores at most `bits_per_element`, as
    /// [`choose_plan`] counts a budget.
    pub fn fits(&self, shape: KvShape, bits_per_element: f64) -> bool {
        self.block_bytes(shape) <= budget_block_bytes(shape, self.layers.len(), bits_per_element)
    }

    /// Bytes of K plus V of one block over all layers.
    pub fn block_bytes(&self, shape: KvShape) -> usize {
        (0..self.layers.len())
            .map(|i| {
                let l = self.layout(i, shape, 1);
                l.key_block_bytes() + l.value_block_bytes()
            })
            .sum()
    }
}

/// The per-layer shape every layer's cache shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

impl KvShape {
    /// Bytes of one block's key bounds in one layer, when the cache keeps
    /// them for sparse drafting: `[kv_heads, 2, head_dim]` f32, each
    /// channel's minimum and maximum (the `kv_key_bounds` kernel's layout).
    pub fn key_bounds_block_bytes(&self) -> usize {
        2 * std::mem::size_of::<f32>() * self.kv_heads * self.head_dim
    }
}

impl fmt::Display for KvPlan {
    /// `keys/values` per layer, runs of equal layers as `pair*N`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut i = 0;
        while i < self.layers.len() {
            let l = self.layers[i];
            let run = self.layers[i..].iter().take_while(|&&x| x == l).count();
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}/{}", l.keys, l.values)?;
            if run > 1 {
                write!(f, "*{run}")?;
            }
            i += run;
        }
        Ok(())
    }
}

impl std::str::FromStr for KvPlan {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let bad = |what: String| Error::InvalidRequest(format!("KV plan `{text}`: {what}"));
        let mut layers = Vec::new();
        for entry in text.split(',') {
            let (pair, count) = match entry.split_once('*') {
                Some((pair, n)) => (
                    pair,
                    n.trim()
                        .parse::<usize>()
                        .ok()
                        .filter(|&n| (1..=4096).contains(&n))
                        .ok_or_else(|| bad(format!("`{n}` is not a layer count")))?,
                ),
                None => (entry, 1),
            };
            let (keys, values) = pair
                .split_once('/')
                .ok_or_else(|| bad(format!("`{pair}` is not KEYS/VALUES (e.g. int8/int4)")))?;
            let keys: KvDtype = keys.trim().parse().map_err(|e| bad(format!("{e}")))?;
            let values: KvDtype = values.trim().parse().map_err(|e| bad(format!("{e}")))?;
            layers.extend(std::iter::repeat_n(LayerKvDtypes { keys, values }, count));
        }
        KvPlan::new(layers)
    }
}

/// The plan of least total sensitivity among the layers' options whose
/// storage is at most `bits_per_element` (as [`KvPlan::bits_per_element`]
/// counts): a multiple-choice knapsack, one item per layer, solved exactly
/// by dynamic programming over the bytes of one block.
pub fn choose_plan(
    sensitivity: &KvSensitivity,
    shape: KvShape,
    bits_per_element: f64,
) -> Result<KvPlan> {
    let layers = sensitivity.keys.len();
    if sensitivity.values.len() != layers || sensitivity.float.len() != layers || layers == 0 {
        return Err(Error::InvalidRequest(
            "KV sensitivity must name the keys, values and floats of every layer".into(),
        ));
    }
    check_kv_budget(shape, layers, bits_per_element)?;
    let block_bytes = |d: LayerKvDtypes| {
        let l = KvPlan { layers: vec![d] }.layout(0, shape, 1);
        l.key_block_bytes() + l.value_block_bytes()
    };
    // Per layer: (dtypes, bytes of one block, loss) of each option.
    let items: Vec<Vec<(LayerKvDtypes, usize, f64)>> = (0..layers)
        .map(|l| {
            sensitivity
                .options(l)
                .into_iter()
                .map(|(d, loss)| (d, block_bytes(d), loss))
                .collect()
        })
        .collect();
    let unit = items.iter().flatten().fold(0, |g, o| gcd(g, o.1)).max(1);
    let cost = |o: &(LayerKvDtypes, usize, f64)| o.1 / unit;
    let budget = budget_block_bytes(shape, layers, bits_per_element) / unit;
    let extreme = |pick: fn(usize, usize) -> usize| -> usize {
        items
            .iter()
            .map(|options| options.iter().map(cost).reduce(pick).unwrap())
            .sum()
    };
    debug_assert!(extreme(usize::min) <= budget, "checked by check_kv_budget");
    let budget = budget.min(extreme(usize::max));
    // best[b]: least loss of the layers so far within b units; choice per layer.
    let mut best = vec![0.0f64; budget + 1];
    let mut choice = vec![vec![0u8; budget + 1]; layers];
    for (layer, options) in items.iter().enumerate() {
        let mut next = vec![f64::INFINITY; budget + 1];
        for b in 0..=budget {
            for (o, option) in options.iter().enumerate() {
                let c = cost(option);
                if c <= b && best[b - c] + option.2 < next[b] {
                    next[b] = best[b - c] + option.2;
                    choice[layer][b] = o as u8;
                }
            }
        }
        best = next;
    }
    let mut b = budget;
    let mut picked = vec![LayerKvDtypes::uniform(PLAN_FLOAT); layers];
    for layer in (0..layers).rev() {
        let option = &items[layer][choice[layer][b] as usize];
        picked[layer] = option.0;
        b -= cost(option);
    }
    KvPlan::new(picked)
}

/// Refuses a budget that is not a positive number or is below the cheapest
/// plan (INT2 everywhere) on `shape` over `layers` layers.
pub fn check_kv_budget(shape: KvShape, layers: usize, bits_per_element: f64) -> Result<()> {
    if !(bits_per_element.is_finite() && bits_per_element > 0.0) {
        return Err(Error::InvalidRequest(format!(
            "KV bits per element must be a positive number, not {bits_per_element}"
        )));
    }
    let cheapest = KvPlan::uniform(KvDtype::Int2, layers);
    if !cheapest.fits(shape, bits_per_element) {
        let floor = cheapest.bits_per_element(shape);
        return Err(Error::InvalidRequest(format!(
            "a KV budget of {bits_per_element} bits per element is below the cheapest plan's {floor:.2}"
        )));
    }
    Ok(())
}

/// Bytes of one block over `layers` layers that `bits_per_element` allows.
fn budget_block_bytes(shape: KvShape, layers: usize, bits_per_element: f64) -> usize {
    let elements = 2 * layers * shape.kv_heads * shape.head_dim * shape.block_size;
    // The tolerance keeps a budget computed from a plan's own bits in reach.
    (bits_per_element * elements as f64 / 8.0 + 1e-6).floor() as usize
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests;
