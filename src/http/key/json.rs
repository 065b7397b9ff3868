//! [`JsonField`]: the key is a field of the JSON body.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::header::CONTENT_LENGTH;
use http::Request;
use http_body::Body;
use http_body_util::BodyExt;

use super::{BoxKeyFuture, KeyExtractor, KeyRejection};

/// Errors that body readers may return.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The key is a field of the JSON body; see [`json_field`].
#[derive(Debug, Clone)]
pub struct JsonField {
    pointer: Arc<str>,
    limit: usize,
}

/// The default body limit of [`JsonField`]: 64 KiB.
pub const DEFAULT_BODY_LIMIT: usize = 64 * 1024;

/// The key is the field at the JSON Pointer `pointer` (RFC 6901, e.g. `/id` or
/// `/data/object/id`) of the JSON body: a string as it is, a number as its decimal text.
/// `null` or an absent field is no key; any other value is rejected (`key-invalid`).
///
/// The body is buffered up to [`limit`](JsonField::limit) bytes (64 KiB by default;
/// larger bodies get 413 `body-too-large` before any lock is taken), and the handler
/// receives the identical bytes, so signatures over the raw body still verify.
/// Trailers of the request body are not passed on. A body that is not JSON gets 400
/// `body-not-json`.
///
/// [`JsonField`] is a [`KeyExtractor`] for bodies that can be rebuilt from [`Bytes`]
/// (`B: From<Bytes>`), such as axum's `Body`.
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
    /// Buffers at most `bytes` of body (default [`DEFAULT_BODY_LIMIT`]).
    #[must_use]
    pub fn limit(mut self, bytes: usize) -> Self {
        self.limit = bytes;
        self
    }

    /// The JSON Pointer of the field.
    pub fn pointer(&self) -> &str {
        &self.pointer
    }

    fn key_of(&self, body: &[u8]) -> Result<Option<String>, KeyRejection> {
        let json: serde_json::Value = serde_json::from_slice(body)
            .map_err(|e| KeyRejection::body_not_json(format!("the body is not JSON: {e}")))?;
        match json.pointer(&self.pointer) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(serde_json::Value::Number(n)) => Ok(Some(n.to_string())),
            Some(other) => Err(KeyRejection::invalid(format!(
                "the body field `{}` is {}, not a string or a number",
                self.pointer,
                match other {
                    serde_json::Value::Bool(_) => "a boolean",
                    serde_json::Value::Array(_) => "an array",
                    _ => "an object",
                }
            ))),
        }
    }
}

impl<B> KeyExtractor<B> for JsonField
where
    B: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Future = BoxKeyFuture<B>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let limit = this.limit;
            let declared = parts
                .headers
                .get(CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            let too_large = |n: u64| n > u64::try_from(limit).unwrap_or(u64::MAX);
            if declared.is_some_and(too_large) || too_large(body.size_hint().lower()) {
                return Err(KeyRejection::body_too_large(limit));
            }
            let bytes = read_limited(body, limit).await?;
            let key = this.key_of(&bytes)?;
            Ok((Request::from_parts(parts, B::from(bytes)), key))
        })
    }

    fn describe(&self) -> String {
        format!("the body field `{}`", self.pointer)
    }
}

/// Reads the data of `body`, failing once it exceeds `limit` bytes.
pub(crate) async fn read_limited<B>(body: B, limit: usize) -> Result<Bytes, KeyRejection>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut rest = BytesMut::new();
    let mut len = 0usize;
    while let Some(frame) = body.as_mut().frame().await {
        let frame = frame.map_err(|e| {
            KeyRejection::body_unreadable(format!("reading the body failed: {}", e.into()))
        })?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        len = len.saturating_add(data.len());
        if len > limit {
            return Err(KeyRejection::body_too_large(limit));
        }
        // The common single-chunk body is passed on without a copy.
        match &first {
            None if rest.is_empty() => first = Some(data),
            _ => {
                if let Some(first) = first.take() {
                    rest.extend_from_slice(&first);
                }
                rest.extend_from_slice(&data);
            }
        }
    }
    Ok(first.unwrap_or_else(|| rest.freeze()))
}
