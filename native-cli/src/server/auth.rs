//! The API key check: `Authorization: Bearer KEY`, the scheme in any case
//! (RFC 7235). The key is compared as SHA-256 digests with a fold that reads
//! every byte, so the time taken says nothing about how much of the key, or
//! of its length, a guess got right.

use axum::http::{header, HeaderMap};
use sha2::{Digest, Sha256};

use crate::api::ApiError;

pub struct ApiKey {
    digest: [u8; 32],
}

impl ApiKey {
    pub fn new(key: &str) -> Self {
        Self {
            digest: digest(key.as_bytes()),
        }
    }

    /// Whether `headers` carry this key.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| bearer_token(v.as_bytes()));
        match given {
            Some(token) if same(&digest(token), &self.digest) => Ok(()),
            _ => Err(
                ApiError::new(401, "invalid_request_error", "Incorrect API key provided")
                    .with_code("invalid_api_key"),
            ),
        }
    }
}

/// The credentials of a `Bearer` authorization value (`bearer`, `BEARER`, ...).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let space = value.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = value.split_at(space);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Equality that looks at every byte whatever the first difference.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn the_scheme_is_case_insensitive_and_the_key_exact() {
        let key = ApiKey::new("sk-test");
        for ok in ["Bearer sk-test", "bearer sk-test", "BEARER  sk-test"] {
            assert!(key.check(&headers(ok)).is_ok(), "{ok}");
        }
        for bad in [
            "Bearer sk-tes",
            "Bearer sk-test2",
            "Bearer SK-TEST",
            "Basic sk-test",
            "Bearersk-test",
            "Bearer ",
            "sk-test",
        ] {
            assert_eq!(key.check(&headers(bad)).unwrap_err().status, 401, "{bad}");
        }
        assert!(key.check(&HeaderMap::new()).is_err());
    }
}
