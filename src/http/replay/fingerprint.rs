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
/// Always covers the method, the route (axum's matched path, else the URI path) and the
/// request's path and query — the same key sent to `/orders/7/pay` and `/orders/8/pay`
/// names one lock under [`Scope::Route`](crate::http::Scope::Route), but two requests — then,
/// by default, the SHA-256 of the whole body. It can instead cover
/// selected JSON fields, or no body, plus selected request headers — the draft's
/// "checksum of selected elements".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    body: BodyPart,
    headers: Vec<HeaderName>,
    pub(super) enabled: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum BodyPart {
    Whole,
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
            headers: Vec::new(),
            enabled: true,
        }
    }

    /// Method, route, path and query only: the body is not read.
    pub fn without_body() -> Self {
        Fingerprint {
            body: BodyPart::Ignored,
            headers: Vec::new(),
            enabled: true,
        }
    }

    /// No check at all: every request with the key gets the recorded response.
    pub fn none() -> Self {
        Fingerprint {
            body: BodyPart::Ignored,
            headers: Vec::new(),
            enabled: false,
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
            BodyPart::Whole => {
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
    use crate::http::problem::ProblemKind;
    use http::Request;

    fn parts(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut builder = Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    #[test]
    fn fingerprints() {
        let default = Fingerprint::default();
        let p = parts("POST", "/pay", &[]);
        let a = default.compute(&p, b"{\"a\":1}").unwrap();
        assert_eq!(a.len(), 32);
        assert_eq!(a, default.compute(&p, b"{\"a\":1}").unwrap());
        assert_ne!(a, default.compute(&p, b"{\"a\":2}").unwrap());
        assert_ne!(
            a,
            default
                .compute(&parts("PUT", "/pay", &[]), b"{\"a\":1}")
                .unwrap()
        );
        assert_ne!(
            a,
            default
                .compute(&parts("POST", "/other", &[]), b"{\"a\":1}")
                .unwrap()
        );
        let with_query = parts("POST", "/pay?x=1", &[]);
        assert_ne!(a, default.compute(&with_query, b"{\"a\":1}").unwrap());

        let fields = Fingerprint::json_fields(["/amount"]).header("x-currency");
        let eur = parts("POST", "/pay", &[("x-currency", "EUR")]);
        let one = fields.compute(&eur, br#"{"amount":1,"note":"x"}"#).unwrap();
        assert_eq!(
            one,
            fields.compute(&eur, br#"{"note":"y","amount":1}"#).unwrap()
        );
        assert_ne!(one, fields.compute(&eur, br#"{"amount":2}"#).unwrap());
        let usd = parts("POST", "/pay", &[("x-currency", "USD")]);
        assert_ne!(one, fields.compute(&usd, br#"{"amount":1}"#).unwrap());
        assert_eq!(
            fields.compute(&eur, b"nope").unwrap_err().kind(),
            ProblemKind::BodyNotJson
        );
        assert!(Fingerprint::none().compute(&eur, b"x").unwrap().is_empty());
        assert!(!Fingerprint::without_body().reads_body());
    }
}
