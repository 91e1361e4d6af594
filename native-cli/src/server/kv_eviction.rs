//! A request's own KV eviction, the server's extension fields named after
//! the command-line flags: `kv_budget` (a token count, or a string `"25%"`
//! of the context), `kv_evict` (`"h2o"`, `"snapkv"`, `"streaming"`),
//! `kv_sinks`, `kv_recent`. Without `kv_budget` the server's default (its
//! `--kv-budget`, or none) applies, and the other three are refused.

use serde_json::Value;
use tandem_core::kv::eviction::DEFAULT_SINKS;
use tandem_core::kv::{EvictionConfig, EvictionPolicy, KvBudget};

use crate::api::{ApiError, Limits};
use crate::fields::Fields;

/// The request's eviction, `None` to use the server's.
pub fn config(f: &Fields<'_>, limits: &Limits<'_>) -> Result<Option<EvictionConfig>, ApiError> {
    let budget = match f.get("kv_budget") {
        None => None,
        Some(Value::Number(n)) => Some(
            n.as_u64()
                .filter(|&n| n > 0)
                .map(|n| KvBudget::Tokens(n as usize))
                .ok_or_else(|| {
                    Fields::wrong(
                        "kv_budget",
                        "a positive token count or a percentage like \"25%\"",
                    )
                })?,
        ),
        Some(Value::String(s)) => Some(
            s.parse::<KvBudget>()
                .map_err(|e| field_error("kv_budget", e))?,
        ),
        Some(_) => {
            return Err(Fields::wrong(
                "kv_budget",
                "a positive token count or a percentage like \"25%\"",
            ))
        }
    };
    let policy = f
        .string("kv_evict")?
        .map(|s| {
            s.parse::<EvictionPolicy>()
                .map_err(|e| field_error("kv_evict", e))
        })
        .transpose()?;
    let sinks = f.integer("kv_sinks", 0, i64::from(u32::MAX))?;
    let recent = f.integer("kv_recent", 0, i64::from(u32::MAX))?;
    let Some(budget) = budget else {
        for (name, set) in [
            ("kv_evict", policy.is_some()),
            ("kv_sinks", sinks.is_some()),
            ("kv_recent", recent.is_some()),
        ] {
            if set {
                return Err(ApiError::bad_request(
                    format!("'{name}' needs 'kv_budget'"),
                    Some(name),
                ));
            }
        }
        return Ok(None);
    };
    let config = EvictionConfig {
        budget,
        policy: policy.unwrap_or(EvictionPolicy::H2o),
        sinks: sinks.map_or(DEFAULT_SINKS, |n| n as usize),
        recent: recent.map(|n| n as usize),
    };
    config
        .plan(limits.max_context, limits.kv_block_size)
        .map_err(|e| field_error("kv_budget", e))?;
    Ok(Some(config))
}

/// The core's message, which names command-line flags, with the field names.
fn field_error(name: &str, e: tandem_core::Error) -> ApiError {
    let message = match e {
        tandem_core::Error::InvalidRequest(m) => m,
        other => other.to_string(),
    };
    let message = ["budget", "evict", "sinks", "recent"]
        .iter()
        .fold(message, |m, n| {
            m.replace(&format!("--kv-{n}"), &format!("'kv_{n}'"))
        });
    ApiError::bad_request(message, Some(name))
}
