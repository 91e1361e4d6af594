//! `--kv-dtype`: one dtype for every layer, a per-layer plan
//! (`plan:KEYS/VALUES,...`), or `auto[:BITS]`, a plan calibrated on the
//! loaded model within BITS per element (`tandem_core::kv::plan`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use tandem_core::backend::KvDtype;
use tandem_core::kv::plan::{AutoKvPlan, DEFAULT_AUTO_BITS};
use tandem_core::kv::{KvPlan, KvPrecision};
use tandem_core::model::kv_calibration::calibration_passes;
use tandem_core::model::ModelFiles;

/// The built-in calibration text: a passage of the second part of Newton's
/// *Opticks* (public domain), apart from the first part the README's
/// perplexity figures are measured on.
const CALIBRATION_TEXT: &str = include_str!("kv_calibration.txt");

/// What `--kv-dtype` asked for, before the model is known.
#[derive(Clone, Debug, PartialEq)]
pub enum KvDtypeArg {
    Uniform(KvDtype),
    Plan(KvPlan),
    Auto { bits_per_element: f64 },
}

impl Default for KvDtypeArg {
    fn default() -> Self {
        KvDtypeArg::Uniform(KvDtype::F32)
    }
}

pub(crate) fn parse_kv_dtype(text: &str) -> std::result::Result<KvDtypeArg, String> {
    let reason = |e: tandem_core::Error| match e {
        tandem_core::Error::InvalidRequest(reason) => reason,
        other => other.to_string(),
    };
    if let Some(spec) = text.strip_prefix("plan:") {
        return spec.parse().map(KvDtypeArg::Plan).map_err(reason);
    }
    if text == "auto" {
        return Ok(KvDtypeArg::Auto {
            bits_per_element: DEFAULT_AUTO_BITS,
        });
    }
    if let Some(bits) = text.strip_prefix("auto:") {
        return match bits.parse::<f64>() {
            Ok(b) if b.is_finite() && b > 0.0 => Ok(KvDtypeArg::Auto {
                bits_per_element: b,
            }),
            _ => Err(format!(
                "`{bits}` in `--kv-dtype auto:{bits}` is not a number of bits per element (e.g. auto:4.5)"
            )),
        };
    }
    text.parse()
        .map(KvDtypeArg::Uniform)
        .map_err(|e| format!("{}, auto[:BITS] or plan:KEYS/VALUES,...", reason(e)))
}

/// `--kv-block-size`: a power of two from 4 to 256 tokens.
pub(crate) fn parse_kv_block_size(text: &str) -> std::result::Result<usize, String> {
    let n: usize = text
        .parse()
        .map_err(|_| format!("'{text}' is not a number of tokens"))?;
    if !(4..=256).contains(&n) || !n.is_power_of_two() {
        return Err(format!(
            "a KV block of {n} tokens: it must be a power of two from 4 to 256"
        ));
    }
    Ok(n)
}

impl std::fmt::Display for KvDtypeArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvDtypeArg::Uniform(d) => write!(f, "{d}"),
            KvDtypeArg::Plan(p) => write!(f, "plan:{p}"),
            KvDtypeArg::Auto { bits_per_element } => write!(f, "auto:{bits_per_element}"),
        }
    }
}

/// Calibration options of `--kv-dtype auto`.
#[derive(clap::Args, Clone, Debug)]
pub struct KvCalibrationArgs {
    /// Text `--kv-dtype auto` calibrates on (default: a built-in passage
    /// of Newton's Opticks).
    #[arg(long, value_name = "FILE")]
    pub kv_calibration: Option<PathBuf>,
    /// Tokens of it each calibration pass reads (the f16 reference, each
    /// uniform key/value pair within the budget, one pass per layer, side
    /// and other dtype, one per layer at f16 and the plan: at most
    /// 5 × layers + 11 passes).
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub kv_calibration_tokens: usize,
}

impl KvDtypeArg {
    /// The engine's precision; `auto` reads and tokenizes the calibration
    /// text here and says on stderr what it is about to do.
    pub fn precision(
        &self,
        calibration: &KvCalibrationArgs,
        files: &ModelFiles,
        block_size: usize,
    ) -> Result<KvPrecision> {
        Ok(match self {
            KvDtypeArg::Uniform(d) => KvPrecision::Uniform(*d),
            KvDtypeArg::Plan(p) => KvPrecision::Plan(p.clone()),
            KvDtypeArg::Auto { bits_per_element } => {
                let text = match &calibration.kv_calibration {
                    Some(path) => std::fs::read_to_string(path)
                        .with_context(|| format!("reading {}", path.display()))?,
                    None => CALIBRATION_TEXT.to_string(),
                };
                let mut tokens = files.tokenizer.encode(&text, false)?;
                tokens.truncate(calibration.kv_calibration_tokens);
                let c = &files.config;
                eprintln!(
                    "calibrating KV precision for {bits_per_element} bits per element: at most {} passes over {} tokens",
                    calibration_passes(c.kv_shape(block_size), c.num_layers, *bits_per_element),
                    tokens.len()
                );
                KvPrecision::Auto(AutoKvPlan {
                    bits_per_element: *bits_per_element,
                    calibration: tokens,
                })
            }
        })
    }

    /// The one dtype of a uniform choice; a plan's and `auto`'s at most
    /// this many bytes of K and V per block of `block_size` tokens over
    /// all layers (what sizes a KV pool by memory before calibration).
    pub fn max_bytes_per_block(&self, files: &ModelFiles, block_size: usize) -> usize {
        let c = &files.config;
        let shape = c.kv_shape(block_size);
        match self {
            KvDtypeArg::Uniform(d) => KvPlan::uniform(*d, c.num_layers).block_bytes(shape),
            KvDtypeArg::Plan(p) => p.block_bytes(shape),
            KvDtypeArg::Auto { bits_per_element } => {
                let elements = 2 * c.num_layers * c.num_kv_heads * c.head_dim * block_size;
                (bits_per_element * elements as f64 / 8.0).ceil() as usize
            }
        }
    }

    /// The one dtype for every layer, if that is what was asked.
    pub fn uniform(&self) -> Option<KvDtype> {
        match self {
            KvDtypeArg::Uniform(d) => Some(*d),
            KvDtypeArg::Plan(p) => p.uniform_dtype(),
            KvDtypeArg::Auto { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_parses_and_bad_ones_say_why() {
        assert_eq!(
            parse_kv_dtype("int4").unwrap(),
            KvDtypeArg::Uniform(KvDtype::Int4)
        );
        assert_eq!(
            parse_kv_dtype("auto").unwrap(),
            KvDtypeArg::Auto {
                bits_per_element: DEFAULT_AUTO_BITS
            }
        );
        assert_eq!(
            parse_kv_dtype("auto:3.5").unwrap(),
            KvDtypeArg::Auto {
                bits_per_element: 3.5
            }
        );
        let plan = parse_kv_dtype("plan:int8/int4*2").unwrap();
        assert_eq!(plan.to_string(), "plan:int8/int4*2");
        for (bad, says) in [
            ("auto:x", "not a number of bits"),
            ("auto:-2", "not a number of bits"),
            ("int3", "auto[:BITS]"),
            ("plan:int8", "KEYS/VALUES"),
            ("plan:f16/int8", "layer 0"),
        ] {
            let err = parse_kv_dtype(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
