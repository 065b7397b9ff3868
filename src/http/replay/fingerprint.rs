//! [`Fingerprint`]: what makes two requests with the same key the same request.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::header::HeaderName;
use http::request::Parts;
use sha2::{Digest, Sha256};

use super::super::key::KeyRejection;
use super::super::policy::matched_path_in;

/// What makes two requests with the same key "the same request", stored with the
/// record: a request whose fingerprint differs gets 422 `idempotency-key-reused`.
///
/// Always covers the method, the route and the request's path and query (one route,
/// `/orders/{id}/pay`, serves many orders); then, by default, the SHA-256 of the whole
/// body, read as JSON when the request says it is JSON (`application/json`, `…+json`):
/// the same parameters are the same request, whatever the whitespace and the order of
/// the keys. It can instead cover the exact bytes, selected JSON fields, or no body,
/// plus selected request headers — the draft's "checksum of selected elements".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    body: BodyPart,
    headers: Vec<HeaderName>,
    pub(super) enabled: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum BodyPart {
    /// JSON by its value, anything else by its bytes.
    Whole,
    /// The bytes as sent.
    Exact,
    JsonFields(Vec<Arc<str>>),
    Ignored,
}

impl Default for Fingerprint {
    /// Method, route, path and query, and the SHA-256 of the whole body.
    fn default() -> Self {
        Fingerprint {
            body: BodyPart::Whole,
            headers: Vec::new(),
            enabled: true,
        }
    }
}

impl Fingerprint {
    /// Method, route, path and query, and the fields at these JSON Pointers (RFC 6901) of the JSON body,
    /// e.g. `["/amount", "/currency"]`: other fields may differ between retries. A
    /// missing field counts as `null`; a body that is not JSON gets 400 `body-not-json`.
    pub fn json_fields<P: Into<Arc<str>>>(pointers: impl IntoIterator<Item = P>) -> Self {
        Fingerprint {
            body: BodyPart::JsonFields(pointers.into_iter().map(Into::into).collect()),
            ..Fingerprint::default()
        }
    }

    /// Method, route, path and query, and the SHA-256 of the body's bytes exactly as
    /// sent, JSON or not: `{"amount": 100}` and `{"amount":100}` are two requests.
    pub fn exact_body() -> Self {
        Fingerprint {
            body: BodyPart::Exact,
            ..Fingerprint::default()
        }
    }

    /// Method, route, path and query only: the body is not read.
    pub fn without_body() -> Self {
        Fingerprint {
            body: BodyPart::Ignored,
            ..Fingerprint::default()
        }
    }

    /// No check at all: every request with the key gets the recorded response.
    pub fn none() -> Self {
        Fingerprint {
            enabled: false,
            ..Fingerprint::without_body()
        }
    }

    /// Also covers the request header `name` (all its values, in order).
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name.
    #[must_use]
    pub fn header<N>(mut self, name: N) -> Self
    where
        N: TryInto<HeaderName>,
        N::Error: fmt::Display,
    {
        match name.try_into() {
            Ok(name) => self.headers.push(name),
            Err(e) => panic!("invalid header name for a fingerprint: {e}"),
        }
        self
    }

    pub(super) fn reads_body(&self) -> bool {
        self.enabled && self.body != BodyPart::Ignored
    }

    /// The fingerprint of a request: empty when disabled.
    pub(super) fn compute(&self, parts: &Parts, body: &[u8]) -> Result<Bytes, KeyRejection> {
        if !self.enabled {
            return Ok(Bytes::new());
        }
        let mut hash = Hasher(Sha256::new());
        hash.part(b"tower-redlock replay fingerprint v1");
        hash.part(parts.method.as_str().as_bytes());
        hash.part(
            matched_path_in(&parts.extensions)
                .unwrap_or_else(|| parts.uri.path())
                .as_bytes(),
        );
        // The route alone is not enough: under one route (`/orders/{id}/pay`) the same
        // key must not replay order 7's answer for order 8.
        hash.part(
            parts
                .uri
                .path_and_query()
                .map_or("", |p| p.as_str())
                .as_bytes(),
        );
        for name in &self.headers {
            hash.part(name.as_str().as_bytes());
            let values = parts.headers.get_all(name);
            hash.part(&(values.iter().count() as u64).to_le_bytes());
            for value in values {
                hash.part(value.as_bytes());
            }
        }
        match &self.body {
            BodyPart::Whole => match canonical_json(parts, body) {
                Some(json) => {
                    hash.part(b"json body");
                    hash.part(&json);
                }
                None => {
                    hash.part(b"body");
                    hash.part(body);
                }
            },
            BodyPart::Exact => {
                hash.part(b"body");
                hash.part(body);
            }
            BodyPart::JsonFields(pointers) => {
                hash.part(b"json");
                let json: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
                    KeyRejection::body_not_json(format!(
                        "the body is not JSON, and the idempotency fingerprint reads JSON fields: {e}"
                    ))
                })?;
                for pointer in pointers {
                    hash.part(pointer.as_bytes());
                    let value = json.pointer(pointer).unwrap_or(&serde_json::Value::Null);
                    // serde_json's maps are sorted: equal values serialise equally.
                    hash.part(value.to_string().as_bytes());
                }
            }
            BodyPart::Ignored => hash.part(b"no body"),
        }
        Ok(Bytes::copy_from_slice(&hash.0.finalize()))
    }
}

/// The body of a request that says it is JSON, written in one canonical form: no
/// whitespace, object keys sorted (serde_json's map is ordered by key). `None` when
/// the request is not JSON or the body does not parse (its bytes count then).
fn canonical_json(parts: &Parts, body: &[u8]) -> Option<Vec<u8>> {
    let content_type = parts
        .headers
        .get(http::header::CONTENT_TYPE)?
        .to_str()
        .ok()?;
    let essence = content_type.split(';').next()?.trim().to_ascii_lowercase();
    let is_json = essence == "application/json" || essence.ends_with("+json");
    if !is_json {
        return None;
    }
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    serde_json::to_vec(&value).ok()
}

/// Feeds length-prefixed parts, so that no two part lists hash the same input.
struct Hasher(Sha256);

impl Hasher {
    fn part(&mut self, bytes: &[u8]) {
        self.0.update((bytes.len() as u64).to_le_bytes());
        self.0.update(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut builder = Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    /// The body, the path and selected fields are tested through the layer
    /// (`tests/http/replay.rs`); the method, the query and the headers here.
    #[test]
    fn fingerprints() {
        let (default, body) = (Fingerprint::default(), b"{\"a\":1}");
        let a = default.compute(&parts("POST", "/pay", &[]), body).unwrap();
        assert_eq!(a.len(), 32);
        for other in [parts("PUT", "/pay", &[]), parts("POST", "/pay?x=1", &[])] {
            assert_ne!(a, default.compute(&other, body).unwrap());
        }
        let fields = Fingerprint::json_fields(["/amount"]).header("x-currency");
        let eur = parts("POST", "/pay", &[("x-currency", "EUR")]);
        let usd = parts("POST", "/pay", &[("x-currency", "USD")]);
        let amount = br#"{"amount":1}"#;
        assert_ne!(fields.compute(&eur, amount), fields.compute(&usd, amount));
        assert!(!Fingerprint::without_body().reads_body());
    }

    #[test]
    fn json_bodies_with_the_same_parameters_are_the_same_request() {
        let default = Fingerprint::default();
        let json = parts(
            "POST",
            "/pay",
            &[("content-type", "application/json; charset=utf-8")],
        );
        let a = default
            .compute(&json, br#"{"amount":100,"currency":"EUR"}"#)
            .unwrap();
        let spaced = br#"{ "currency" : "EUR",
            "amount": 100 }"#;
        assert_eq!(a, default.compute(&json, spaced).unwrap());
        assert_ne!(
            a,
            default
                .compute(&json, br#"{"amount":101,"currency":"EUR"}"#)
                .unwrap()
        );
        let problem = parts(
            "POST",
            "/pay",
            &[("content-type", "application/merge-patch+json")],
        );
        assert_eq!(
            default.compute(&problem, br#"{"a":1,"b":2}"#).unwrap(),
            default.compute(&problem, br#"{"b":2, "a":1}"#).unwrap()
        );
        // Not declared JSON, or not parsing: the bytes count.
        let text = parts("POST", "/pay", &[("content-type", "text/plain")]);
        assert_ne!(
            default.compute(&text, br#"{"a":1}"#).unwrap(),
            default.compute(&text, br#"{ "a":1}"#).unwrap()
        );
        assert_ne!(
            default.compute(&json, b"{not json").unwrap(),
            default.compute(&json, b"{not  json").unwrap()
        );
        // Byte-exact on request.
        let exact = Fingerprint::exact_body();
        assert_ne!(
            exact.compute(&json, br#"{"a":1}"#).unwrap(),
            exact.compute(&json, br#"{"a": 1}"#).unwrap()
        );
    }
}
