//! The JavaScript side of the API: options read field by field with an error
//! naming the field, chat messages, and the `info()` object.

use js_sys::{Array, Object, Reflect};
use wasm_bindgen::prelude::*;

use tandem_core::backend::KvDtype;
use tandem_core::kv::eviction::DEFAULT_SINKS;
use tandem_core::kv::{EvictionConfig, EvictionPolicy, KvBudget, DEFAULT_BLOCK_SIZE};
use tandem_core::tokenizer::ChatMessage;

use crate::source::Origin;

/// The Cache API cache downloaded models go to unless `options.cache` names another.
const DEFAULT_CACHE: &str = "tandem-models-v1";

/// What `Tandem.info()` returns.
pub struct Info {
    pub model: String,
    pub source: Origin,
    pub model_bytes: usize,
    pub backend: String,
    /// Why this backend runs (`backendReason`).
    pub backend_reason: String,
    pub adapter: String,
    pub features: Features,
    /// Set when `auto` settled on the CPU backend: why WebGPU was not taken.
    pub fallback_reason: Option<String>,
    pub kv_dtype: KvDtype,
    pub kv_bytes_per_token: usize,
    /// Tokens per sequence, prompt and output together.
    pub context: usize,
    /// The CPU backend's threads; `None` on WebGPU.
    pub threads: Option<CpuThreads>,
}

pub struct CpuThreads {
    pub count: usize,
    /// Why fewer than asked for run, when they do.
    pub fewer_reason: Option<String>,
}

#[derive(Default)]
pub struct Features {
    pub shader_f16: bool,
    pub subgroups: bool,
    pub uses_f16: bool,
    pub uses_subgroups: bool,
}

impl Info {
    pub fn to_js(&self) -> Result<Object, JsError> {
        let features = Object::new();
        set(&features, "shaderF16", self.features.shader_f16.into())?;
        set(&features, "subgroups", self.features.subgroups.into())?;
        set(&features, "usesF16", self.features.uses_f16.into())?;
        set(
            &features,
            "usesSubgroups",
            self.features.uses_subgroups.into(),
        )?;
        let info = Object::new();
        set(&info, "model", self.model.as_str().into())?;
        set(&info, "source", self.source.as_str().into())?;
        set(&info, "modelBytes", (self.model_bytes as f64).into())?;
        set(&info, "backend", self.backend.as_str().into())?;
        set(&info, "backendReason", self.backend_reason.as_str().into())?;
        set(&info, "adapter", self.adapter.as_str().into())?;
        set(&info, "features", features.into())?;
        let reason = self
            .fallback_reason
            .as_deref()
            .map_or(JsValue::NULL, JsValue::from);
        set(&info, "fallbackReason", reason)?;
        set(&info, "kvDtype", self.kv_dtype.name().into())?;
        set(
            &info,
            "kvBytesPerToken",
            (self.kv_bytes_per_token as f64).into(),
        )?;
        set(&info, "context", (self.context as f64).into())?;
        let (count, reason) = match &self.threads {
            Some(t) => ((t.count as f64).into(), t.fewer_reason.as_deref().into()),
            None => (JsValue::NULL, JsValue::NULL),
        };
        set(&info, "threads", count)?;
        set(&info, "threadsReason", reason)?;
        Ok(info)
    }
}

/// `[{ role, content }]` from JavaScript.
pub fn chat_messages(messages: &JsValue) -> Result<Vec<ChatMessage>, JsError> {
    let wrong = || {
        JsError::new(
            "messages must be a non-empty array of { role, content } objects \
             whose role and content are strings",
        )
    };
    if !Array::is_array(messages) {
        return Err(wrong());
    }
    let messages = Array::from(messages);
    if messages.length() == 0 {
        return Err(wrong());
    }
    messages
        .iter()
        .map(|m| {
            let field = |key: &str| {
                Reflect::get(&m, &key.into())
                    .ok()
                    .and_then(|v| v.as_string())
                    .ok_or_else(wrong)
            };
            Ok(ChatMessage::new(field("role")?, field("content")?))
        })
        .collect()
}

pub fn get(object: &Object, key: &str) -> Result<JsValue, JsError> {
    Reflect::get(object, &key.into())
        .map_err(|_| JsError::new(&format!("cannot read option {key}")))
}

fn set(object: &Object, key: &str, value: JsValue) -> Result<(), JsError> {
    Reflect::set(object, &key.into(), &value)
        .map(drop)
        .map_err(|_| JsError::new(&format!("cannot set {key}")))
}

pub fn number_option(options: &Object, key: &str) -> Result<Option<f64>, JsError> {
    let value = get(options, key)?;
    if value.is_undefined() || value.is_null() {
        return Ok(None);
    }
    match value.as_f64() {
        Some(n) if n.is_finite() => Ok(Some(n)),
        _ => Err(JsError::new(&format!(
            "option {key} must be a finite number"
        ))),
    }
}

/// `options.cache`: the cache's name, or `None` for no caching.
pub fn cache_option(options: &Object) -> Result<Option<String>, JsError> {
    let value = get(options, "cache")?;
    if value.is_undefined() || value.is_null() || value.as_bool() == Some(true) {
        return Ok(Some(DEFAULT_CACHE.into()));
    }
    if value.as_bool() == Some(false) {
        return Ok(None);
    }
    match value.as_string() {
        Some(name) if !name.is_empty() => Ok(Some(name)),
        _ => Err(JsError::new(
            "option cache must be true, false or the name of a cache",
        )),
    }
}

pub fn string_option(options: &Object, key: &str) -> Result<Option<String>, JsError> {
    let value = get(options, key)?;
    if value.is_undefined() || value.is_null() {
        return Ok(None);
    }
    value
        .as_string()
        .map(Some)
        .ok_or_else(|| JsError::new(&format!("option {key} must be a string")))
}

/// A generation's KV eviction, the options named after `--kv-budget`,
/// `--kv-evict`, `--kv-sinks` and `--kv-recent`: `kvBudget` (a token count,
/// or a string like `"25%"` of the context of `context` tokens), `kvEvict`
/// (`"h2o"`, the default, `"snapkv"` or `"streaming"`), `kvSinks`,
/// `kvRecent`. `None` without `kvBudget`, where the other three are refused.
pub fn eviction_option(
    options: &Object,
    context: usize,
) -> Result<Option<EvictionConfig>, JsError> {
    let budget = get(options, "kvBudget")?;
    let budget = if budget.is_undefined() || budget.is_null() {
        None
    } else if let Some(text) = budget.as_string() {
        Some(text.parse::<KvBudget>().map_err(renamed)?)
    } else {
        match budget.as_f64() {
            Some(n) if n >= 1.0 && n.fract() == 0.0 && n <= u32::MAX as f64 => {
                Some(KvBudget::Tokens(n as usize))
            }
            _ => {
                return Err(JsError::new(
                    "option kvBudget must be a positive whole number of tokens or a percentage like \"25%\"",
                ))
            }
        }
    };
    let policy = string_option(options, "kvEvict")?
        .map(|name| name.parse::<EvictionPolicy>().map_err(renamed))
        .transpose()?;
    let sinks = count_option(options, "kvSinks")?;
    let recent = count_option(options, "kvRecent")?;
    let Some(budget) = budget else {
        for (name, set) in [
            ("kvEvict", policy.is_some()),
            ("kvSinks", sinks.is_some()),
            ("kvRecent", recent.is_some()),
        ] {
            if set {
                return Err(JsError::new(&format!("option {name} needs kvBudget")));
            }
        }
        return Ok(None);
    };
    let config = EvictionConfig {
        budget,
        policy: policy.unwrap_or(EvictionPolicy::H2o),
        sinks: sinks.unwrap_or(DEFAULT_SINKS),
        recent,
    };
    config.plan(context, DEFAULT_BLOCK_SIZE).map_err(renamed)?;
    Ok(Some(config))
}

/// A whole, non-negative option.
fn count_option(options: &Object, key: &str) -> Result<Option<usize>, JsError> {
    match number_option(options, key)? {
        None => Ok(None),
        Some(n) if n >= 0.0 && n.fract() == 0.0 && n <= u32::MAX as f64 => Ok(Some(n as usize)),
        Some(_) => Err(JsError::new(&format!(
            "option {key} must be a whole number of tokens, 0 or more"
        ))),
    }
}

/// The core's message, which names command-line flags, with the options' names.
fn renamed(e: tandem_core::Error) -> JsError {
    let message = match e {
        tandem_core::Error::InvalidRequest(m) => m,
        other => other.to_string(),
    };
    let message = [
        ("--kv-budget", "kvBudget"),
        ("--kv-evict", "kvEvict"),
        ("--kv-sinks", "kvSinks"),
        ("--kv-recent", "kvRecent"),
    ]
    .iter()
    .fold(message, |m, (flag, option)| m.replace(flag, option));
    JsError::new(&message)
}
