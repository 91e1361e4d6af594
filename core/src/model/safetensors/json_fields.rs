//! Typed reads of a JSON object's fields (`config.json`), with errors that
//! name the field and show its value: serde's own errors name neither.

// Read only by the directory loader, which the browser lacks.
#![cfg_attr(target_arch = "wasm32", allow(dead_code))]

use std::path::Path;

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::{Error, Result};

/// Typed reads of a JSON object's fields, with errors that name the field:
/// absent and `null` are the same, a value of the wrong type is an error.
pub(super) struct Fields<'a> {
    pub object: &'a Map<String, Value>,
    /// The object's name in messages (`rope_scaling.`), empty at the top level.
    pub prefix: &'a str,
    pub path: &'a Path,
}

impl Fields<'_> {
    pub fn optional<T: DeserializeOwned>(&self, key: &str, expected: &str) -> Result<Option<T>> {
        let Some(value) = self.object.get(key).filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        T::deserialize(value).map(Some).map_err(|_| {
            let mut shown = value.to_string();
            if shown.len() > 64 {
                shown = format!("{}…", shown.chars().take(64).collect::<String>());
            }
            Error::bad_file(
                self.path,
                format!("'{}{key}' is {shown}, expected {expected}", self.prefix),
            )
        })
    }

    pub fn required<T: DeserializeOwned>(&self, key: &str, expected: &str) -> Result<T> {
        self.optional(key, expected)?
            .ok_or_else(|| Error::bad_file(self.path, format!("missing '{}{key}'", self.prefix)))
    }

    pub fn size(&self, key: &str) -> Result<usize> {
        self.required(key, "a non-negative integer")
    }

    pub fn optional_size(&self, key: &str) -> Result<Option<usize>> {
        self.optional(key, "a non-negative integer")
    }

    pub fn number(&self, key: &str) -> Result<Option<f32>> {
        self.optional(key, "a number")
    }

    pub fn text(&self, key: &str) -> Result<Option<String>> {
        self.optional(key, "a string")
    }

    pub fn flag(&self, key: &str) -> Result<Option<bool>> {
        self.optional(key, "true or false")
    }

    /// A value that must be finite and above 0 (a RoPE base or factor, a scale).
    pub fn positive(&self, key: &str) -> Result<Option<f32>> {
        self.number_where(key, "finite and above 0", |x| x.is_finite() && x > 0.0)
    }

    /// A number that must satisfy `valid`, which `rule` states for the message.
    pub fn number_where(
        &self,
        key: &str,
        rule: &str,
        valid: impl Fn(f32) -> bool,
    ) -> Result<Option<f32>> {
        let value = self.number(key)?;
        match value {
            Some(x) if !valid(x) => Err(Error::bad_file(
                self.path,
                format!("'{}{key}' is {x}; it must be {rule}", self.prefix),
            )),
            _ => Ok(value),
        }
    }

    /// A size that must be at least 1 when given (a window of 0 tokens would
    /// fail every request later).
    pub fn nonzero_size(&self, key: &str) -> Result<Option<usize>> {
        match self.optional_size(key)? {
            Some(0) => Err(Error::bad_file(
                self.path,
                format!("'{}{key}' is 0; it must be at least 1", self.prefix),
            )),
            size => Ok(size),
        }
    }
}
