//! [`JsonField`]: the key is a field of the JSON body; [`JsonFields`]: each of several
//! fields is a key.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;

use super::each::gather;
use super::{KeyExtractor, KeyRejection};

/// The key is a field of the JSON body; see [`json_field`].
#[derive(Debug, Clone)]
pub struct JsonField {
    pointer: Arc<str>,
    limit: usize,
}

/// The default body limit of [`JsonField`]: 64 KiB.
pub(crate) const DEFAULT_BODY_LIMIT: usize = 64 * 1024;

/// The key is the field at the JSON Pointer `pointer` (RFC 6901, e.g. `/id` or
/// `/data/object/id`) of the JSON body: a string as it is, a number as its decimal text.
/// `null` or an absent field is no key; any other value is rejected (`key-invalid`).
///
/// The body is buffered up to [`limit`](JsonField::limit) bytes (larger bodies get 413
/// `body-too-large` before any lock is taken), and the handler receives the identical
/// bytes, without trailers. A body that is not JSON gets 400 `body-not-json`.
///
/// # Panics
///
/// When `pointer` is neither empty nor starts with `/`.
pub fn json_field(pointer: impl Into<Arc<str>>) -> JsonField {
    let pointer = pointer.into();
    assert!(
        pointer.is_empty() || pointer.starts_with('/'),
        "a JSON Pointer is empty or starts with `/`, got {pointer:?}"
    );
    JsonField {
        pointer,
        limit: DEFAULT_BODY_LIMIT,
    }
}

impl JsonField {
    setters!({
        /// Buffers at most `limit` bytes of body (default 64 KiB).
        limit: usize;
    });

    /// The JSON Pointer of the field.
    pub fn pointer(&self) -> &str {
        &self.pointer
    }
}

/// The body, parsed: 413 when read for a wider limit (another key's, replay's) than
/// `limit`, 400 `body-not-json` when it is not JSON.
fn parse(body: &[u8], limit: usize) -> Result<serde_json::Value, KeyRejection> {
    if body.len() > limit {
        return Err(KeyRejection::body_too_large(limit));
    }
    serde_json::from_slice(body)
        .map_err(|e| KeyRejection::body_not_json(format!("the body is not JSON: {e}")))
}

/// The key at `pointer` of `json`: a string as it is, a number as its decimal text;
/// `None` for `null` or no such field.
fn field_of(json: &serde_json::Value, pointer: &str) -> Result<Option<String>, KeyRejection> {
    match json.pointer(pointer) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Number(n)) => Ok(Some(n.to_string())),
        Some(other) => Err(KeyRejection::invalid(format!(
            "the body field `{pointer}` is {}, not a string or a number",
            match other {
                serde_json::Value::Bool(_) => "a boolean",
                serde_json::Value::Array(_) => "an array",
                _ => "an object",
            }
        ))),
    }
}

impl KeyExtractor for JsonField {
    type Keys = String;
    type Body = Bytes;

    fn keys(&self, _parts: &mut Parts, body: &[u8]) -> Result<Option<String>, KeyRejection> {
        field_of(&parse(body, self.limit)?, &self.pointer)
    }

    fn body_limit(&self) -> Option<usize> {
        Some(self.limit)
    }

    fn describe(&self) -> String {
        format!("the body field `{}`", self.pointer)
    }
}

/// Several fields of the JSON body, each key a resource of its own; see [`json_fields`].
#[derive(Debug, Clone)]
pub struct JsonFields {
    pointers: Arc<[Arc<str>]>,
    limit: usize,
}

/// A multi-key extractor: the fields at the JSON Pointers `pointers` of the JSON body,
/// each key a resource of its own, locked as one lease. The body is buffered and parsed
/// once; each field is read as [`json_field`] reads one, with the same limit and the
/// same problems.
///
/// A body with some of the fields and not others gets 400 `key-missing` naming the
/// missing ones; two fields with the same value name one resource.
///
/// # Panics
///
/// When a pointer is neither empty nor starts with `/`, or there is no pointer.
pub fn json_fields<P: Into<Arc<str>>>(pointers: impl IntoIterator<Item = P>) -> JsonFields {
    let pointers: Arc<[Arc<str>]> = pointers
        .into_iter()
        .map(|p| json_field(p).pointer)
        .collect();
    assert!(
        !pointers.is_empty(),
        "json_fields needs at least one JSON Pointer"
    );
    JsonFields {
        pointers,
        limit: DEFAULT_BODY_LIMIT,
    }
}

impl JsonFields {
    setters!({
        /// Buffers at most `limit` bytes of body (default 64 KiB).
        limit: usize;
    });
}

impl KeyExtractor for JsonFields {
    type Keys = Vec<String>;
    type Body = Bytes;

    fn keys(&self, _parts: &mut Parts, body: &[u8]) -> Result<Option<Vec<String>>, KeyRejection> {
        let json = parse(body, self.limit)?;
        let found = self
            .pointers
            .iter()
            .map(|pointer| field_of(&json, pointer))
            .collect::<Result<Vec<_>, _>>()?;
        gather(found, |index| self.describe_key(index))
    }

    fn body_limit(&self) -> Option<usize> {
        Some(self.limit)
    }

    fn describe(&self) -> String {
        let fields = (0..self.pointers.len()).map(|index| self.describe_key(index));
        fields.collect::<Vec<_>>().join(" and ")
    }

    fn describe_key(&self, index: usize) -> String {
        match self.pointers.get(index) {
            Some(pointer) => format!("the body field `{pointer}`"),
            None => format!("lock key {}", index + 1),
        }
    }
}
