//! The recorded response and its wire format.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{
    HeaderName, HeaderValue, CONTENT_ENCODING, CONTENT_LANGUAGE, CONTENT_LOCATION, CONTENT_RANGE,
    CONTENT_TYPE,
};
use http::{HeaderMap, StatusCode};

/// A response as recorded: status, allowed headers, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

/// Format version of [`StoredResponse::encode`].
const FORMAT: u8 = 1;

/// The headers that say what the stored bytes are (RFC 9110's representation metadata
/// and the range a partial body covers): recorded with every body, whatever the
/// allow-list, since a body replayed without them means something else (gzip bytes
/// without `Content-Encoding` are garbage to the client).
const REPRESENTATION: [HeaderName; 5] = [
    CONTENT_TYPE,
    CONTENT_ENCODING,
    CONTENT_LANGUAGE,
    CONTENT_LOCATION,
    CONTENT_RANGE,
];

impl StoredResponse {
    /// Keeps the headers of `all` that the allow-list names, and always the
    /// representation headers (see [`REPRESENTATION`]).
    pub(crate) fn new(
        status: StatusCode,
        all: &HeaderMap,
        allowed: &[HeaderName],
        body: Bytes,
    ) -> Self {
        let mut headers = HeaderMap::new();
        let representation = REPRESENTATION.iter().filter(|name| !allowed.contains(name));
        for name in allowed.iter().chain(representation) {
            for value in all.get_all(name) {
                headers.append(name.clone(), value.clone());
            }
        }
        StoredResponse {
            status,
            headers,
            body,
        }
    }

    /// `1`, status (u16), header count (u16), then per header name length (u16), name,
    /// value length (u32), value; then the body to the end. Big-endian.
    pub(crate) fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.body.len() + 64);
        out.put_u8(FORMAT);
        out.put_u16(self.status.as_u16());
        out.put_u16(u16::try_from(self.headers.len()).unwrap_or(u16::MAX));
        for (name, value) in self.headers.iter().take(usize::from(u16::MAX)) {
            out.put_u16(name.as_str().len() as u16);
            out.put_slice(name.as_str().as_bytes());
            out.put_u32(value.len() as u32);
            out.put_slice(value.as_bytes());
        }
        out.put_slice(&self.body);
        out.freeze()
    }

    /// Reads what [`encode`](StoredResponse::encode) wrote; `None` if malformed.
    pub(crate) fn decode(mut data: Bytes) -> Option<Self> {
        if data.remaining() < 5 || data.get_u8() != FORMAT {
            return None;
        }
        let status = StatusCode::from_u16(data.get_u16()).ok()?;
        let count = data.get_u16();
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            if data.remaining() < 2 {
                return None;
            }
            let len = usize::from(data.get_u16());
            if data.remaining() < len + 4 {
                return None;
            }
            let name = HeaderName::from_bytes(&data.split_to(len)).ok()?;
            let len = data.get_u32() as usize;
            if data.remaining() < len {
                return None;
            }
            let value = HeaderValue::from_maybe_shared(data.split_to(len)).ok()?;
            headers.append(name, value);
        }
        Some(StoredResponse {
            status,
            headers,
            body: data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What is kept, and its round trip, are tested through the layer
    /// (`the_first_response_is_replayed_byte_identical`); malformed records here.
    #[test]
    fn truncations_and_garbage_are_refused() {
        let mut all = HeaderMap::new();
        all.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let stored = StoredResponse::new(StatusCode::CREATED, &all, &[], Bytes::from("{}"));
        let encoded = stored.encode();
        for cut in 0..encoded.len() - stored.body.len() {
            assert!(
                StoredResponse::decode(encoded.slice(..cut)).is_none(),
                "{cut}"
            );
        }
        assert!(StoredResponse::decode(Bytes::from_static(b"\x02\x00\xc8\x00\x00")).is_none());
    }

    #[test]
    fn representation_headers_are_kept_with_the_body() {
        let mut all = HeaderMap::new();
        all.insert(CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        all.insert(CONTENT_LANGUAGE, HeaderValue::from_static("de"));
        all.insert("x-other", HeaderValue::from_static("1"));
        let stored =
            StoredResponse::new(StatusCode::OK, &all, &[], Bytes::from_static(b"\x1f\x8b"));
        assert_eq!(stored.headers[CONTENT_ENCODING], "gzip");
        assert_eq!(stored.headers[CONTENT_LANGUAGE], "de");
        assert!(!stored.headers.contains_key("x-other"));
        // Named in the allow-list too: kept once.
        let twice = StoredResponse::new(StatusCode::OK, &all, &[CONTENT_ENCODING], Bytes::new());
        assert_eq!(twice.headers.get_all(CONTENT_ENCODING).iter().count(), 1);
    }
}
