//! The sampling fields of a request, checked into [`SamplingParams`]:
//! OpenAI's `temperature`, `top_p`, `frequency_penalty`,
//! `presence_penalty`, `logit_bias` and `seed`, and vLLM's `top_k`, `min_p`
//! and `repetition_penalty`.

use serde_json::Value;
use tandem_core::sched::SamplingParams;

use crate::api::{ApiError, Limits};
use crate::fields::Fields;

/// Most entries a `logit_bias` may have (OpenAI's limit).
const MAX_LOGIT_BIAS_ENTRIES: usize = 300;

/// The sampling parameters of a request.
pub fn params(f: &Fields<'_>, limits: &Limits<'_>) -> Result<SamplingParams, ApiError> {
    let temperature = f.number("temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32;
    let top_p = f.number("top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32;
    if top_p <= 0.0 {
        return Err(Fields::wrong("top_p", "greater than 0"));
    }
    // vLLM's -1 and 0 both mean "every token".
    let top_k = f.integer("top_k", -1, i64::MAX)?.unwrap_or(0).max(0) as usize;
    let min_p = f.number("min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32;
    let repeat_penalty = match f.number("repetition_penalty", 0.0, 2.0)? {
        Some(p) if p <= 0.0 => {
            return Err(Fields::wrong(
                "repetition_penalty",
                "a number greater than 0, at most 2",
            ))
        }
        Some(p) => p as f32,
        None => 1.0,
    };
    let frequency_penalty = f.number("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    let presence_penalty = f.number("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    let seed = match f.get("seed") {
        Some(v) => v
            .as_i64()
            .map(|s| s as u64)
            .or_else(|| v.as_u64())
            .ok_or_else(|| Fields::wrong("seed", "an integer"))?,
        None => limits.default_seed,
    };
    Ok(SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repeat_penalty,
        frequency_penalty,
        presence_penalty,
        logit_bias: logit_bias(f.get("logit_bias"), limits.tokenizer.vocab_size())?,
        seed,
        ..SamplingParams::default()
    })
}

/// OpenAI's `logit_bias`: an object from token ids (as strings) to a bias
/// from -100 to 100, added to the token's logit.
fn logit_bias(value: Option<&Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(value) = value else {
        return Ok(Vec::new());
    };
    let entries = value.as_object().ok_or_else(|| {
        Fields::wrong(
            "logit_bias",
            "an object from token ids to biases, like {\"50256\": -100}",
        )
    })?;
    if entries.len() > MAX_LOGIT_BIAS_ENTRIES {
        return Err(Fields::wrong(
            "logit_bias",
            &format!("at most {MAX_LOGIT_BIAS_ENTRIES} entries"),
        ));
    }
    entries
        .iter()
        .map(|(key, bias)| {
            let token = key
                .parse::<u32>()
                .ok()
                .filter(|&t| (t as usize) < vocab)
                .ok_or_else(|| {
                    Fields::wrong(
                        "logit_bias",
                        &format!(
                            "keyed by token ids below the vocabulary size {vocab}; '{key}' is not one"
                        ),
                    )
                })?;
            let bias = bias
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| {
                    Fields::wrong(
                        "logit_bias",
                        &format!("biases from -100 to 100; token {key} has {bias}"),
                    )
                })?;
            Ok((token, bias as f32))
        })
        .collect()
}
