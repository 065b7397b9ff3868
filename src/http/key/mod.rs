//! Where the lock keys of a request come from: one trait, [`KeyExtractor`].
//!
//! An extractor reads the request head, and the body when it says so, and answers
//! `Ok(Some(keys))`, `Ok(None)` when the request carries no key (the layer then applies
//! [`MissingKey`](super::MissingKey)), or a [`KeyRejection`] when the request is
//! malformed. Ambiguous keys are rejected rather than guessed: a header or query
//! parameter that appears twice could make the lock protect one value while the handler
//! reads the other.
//!
//! - **One key** (`type Keys = String`): [`header`], [`query_param`], `path_param`
//!   (feature `axum`), [`json_field`], the [`webhook`] presets, tuples of up to four
//!   (all parts required, joined into one key so that `("ab", "c")` and `("a", "bc")`
//!   stay distinct), [`or`](KeyExtractor::or), [`parse`](KeyExtractor::parse),
//!   [`normalize`](KeyExtractor::normalize), and every closure
//!   `Fn(&Parts) -> Option<String>`.
//! - **Several keys** (`type Keys = Vec<String>`), each a resource of its own, locked
//!   together as one lease: [`json_fields`], [`each`], [`keys_fn`]. A request with some
//!   of them and not others is refused with 400 `key-missing` naming the missing ones;
//!   more distinct keys than [`MAX_RESOURCES_PER_LEASE`](crate::MAX_RESOURCES_PER_LEASE)
//!   get 400 `key-invalid`. [Replay](super::replay) takes one key per request, and the
//!   `Locked` extractor (feature `axum`) a head extractor (`type Body = ()`).
//!
//! The layer checks every key: not empty, at most
//! [`max_key_len`](super::LockLayer::max_key_len) bytes of UTF-8, no control
//! characters.
//!
//! ```
//! use bytes::Bytes;
//! use http::request::Parts;
//! use tower_redlock::http::key::{KeyExtractor, KeyRejection};
//! use tower_redlock::http::{LockLayer, Scope};
//! use tower_redlock::Redlock;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! /// Every `sku` of an order's lines, `{"lines": [{"sku": "a"}, {"sku": "b"}]}`: the
//! /// stock of each is locked, as one lease.
//! #[derive(Clone)]
//! struct Skus;
//!
//! impl KeyExtractor for Skus {
//!     type Keys = Vec<String>;
//!     type Body = Bytes; // the layer reads the body (64 KiB at most) and passes it on
//!
//!     fn keys(&self, _parts: &mut Parts, body: &[u8]) -> Result<Option<Vec<String>>, KeyRejection> {
//!         let order: serde_json::Value = serde_json::from_slice(body)
//!             .map_err(|e| KeyRejection::body_not_json(e.to_string()))?;
//!         let skus: Vec<String> = order["lines"]
//!             .as_array()
//!             .into_iter()
//!             .flatten()
//!             .filter_map(|line| line["sku"].as_str().map(str::to_owned))
//!             .collect();
//!         Ok((!skus.is_empty()).then_some(skus))
//!     }
//!
//!     fn describe(&self) -> String {
//!         "the `sku` of every line of the body".to_owned()
//!     }
//! }
//!
//! let body = br#"{"lines": [{"sku": "a"}, {"sku": "b"}]}"#;
//! let (mut parts, ()) = http::Request::new(()).into_parts();
//! assert_eq!(Skus.keys(&mut parts, body).unwrap(), Some(vec!["a".into(), "b".into()]));
//! let layer = LockLayer::new(Redlock::in_memory(), Skus).scope(Scope::shared("stock"));
//! # let _ = layer;
//! # }
//! ```

mod combine;
mod each;
mod head;
mod json;
mod rejection;
pub mod webhook;

use std::fmt;

use http::request::Parts;

pub(crate) use combine::reads;
// Every head extractor is named here, as a `LockKey` names its type. `JsonFields` and
// `Normalized` are public in private modules: their builders return them, and nobody
// writes their names (a body key cannot be a `LockKey`'s).
use combine::Normalized;
pub use combine::Or;
pub use each::{each, keys_fn, Each, KeysFn};
pub use head::{header, query_param, Header, QueryParam};
#[cfg(feature = "axum")]
pub use head::{path_param, PathParam};
pub(crate) use json::DEFAULT_BODY_LIMIT;
pub use json::{json_field, json_fields, JsonField};
pub use rejection::KeyRejection;
pub(crate) use sealed::{Found, HeadOnly, KeySet, OneKey, Read};

/// Finds the lock keys of a request.
///
/// `Keys` says how many: `String`, one key (one resource, one `Fencing-Token`), or
/// `Vec<String>`, several (one resource each, one lease over all). `Body` says what is
/// read: `()`, the request head alone (any request body type; what the `Locked`
/// extractor takes), or [`Bytes`](bytes::Bytes), the body too, which the layer buffers (up to
/// [`body_limit`](KeyExtractor::body_limit); larger bodies get 413 `body-too-large`
/// before any lock is taken) and hands on to the handler unchanged, for request bodies
/// that are `From<Bytes>` with `Bytes` data, as axum's `Body`. See the
/// [module documentation](self) for an example.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a key extractor",
    label = "a key extractor expected here",
    note = "use `header`, `path_param`, `query_param`, `json_field`, `json_fields`, `each`, `keys_fn`, a tuple, or a closure `Fn(&Parts) -> Option<String>`",
    note = "see https://docs.rs/tower-redlock/latest/tower_redlock/http/key/index.html"
)]
pub trait KeyExtractor: Clone + Send + Sync + 'static {
    /// `String` for one key, `Vec<String>` for several.
    type Keys: sealed::KeySet;

    /// `()` when the request head is enough, [`Bytes`](bytes::Bytes) when the body is
    /// read too.
    type Body: sealed::Reads;

    /// The keys of the request with head `parts` (and body `body` when `Body = Bytes`;
    /// empty otherwise): `Ok(None)` when it has none.
    fn keys(&self, parts: &mut Parts, body: &[u8]) -> Result<Option<Self::Keys>, KeyRejection>;

    /// The most body bytes to read (`Body = Bytes` only; default 64 KiB).
    fn body_limit(&self) -> Option<usize> {
        <Self::Body as sealed::Reads>::LIMIT
    }

    /// What this extractor looks for, for the `detail` of a `key-missing` problem,
    /// e.g. ``the `idempotency-key` header``.
    fn describe(&self) -> String {
        "a lock key".to_owned()
    }

    /// What key `index` of several is, for the `detail` of a `key-invalid` problem
    /// about it (e.g. ``the body field `/to` ``).
    fn describe_key(&self, index: usize) -> String {
        format!("lock key {}", index + 1)
    }

    /// This extractor, falling back to `fallback` when it finds no key. A rejection of
    /// the first extractor is not overruled by the fallback.
    fn or<F>(self, fallback: F) -> Or<Self, F>
    where
        Self: KeyExtractor<Keys = String>,
        F: KeyExtractor<Keys = String>,
    {
        Or {
            first: self,
            fallback,
        }
    }

    /// This extractor's key as the handler reads it: parsed as `T` and locked in `T`'s
    /// canonical form (its `Display`), so that the spellings a handler treats as one
    /// value lock one resource. `path_param("id").parse::<u64>()` locks `/orders/007` and
    /// `/orders/7` as the same order, as a `Path<u64>` handler sees them; a key that does
    /// not parse gets 400 `key-invalid`, as the handler's extractor would refuse it.
    #[allow(clippy::type_complexity)]
    fn parse<T>(self) -> Normalized<Self, fn(String) -> Result<String, String>>
    where
        Self: KeyExtractor<Keys = String>,
        T: std::str::FromStr + fmt::Display + 'static,
    {
        self.normalize(combine::canonical::<T>)
    }

    /// This extractor's key passed through `normalize`, which returns the key to lock
    /// (e.g. a UUID in lower case) or why the key is not acceptable (400 `key-invalid`,
    /// with the reason in the problem's detail): e.g.
    /// `path_param("id").normalize(|id: String| Ok(id.to_ascii_lowercase()))`.
    fn normalize<F>(self, normalize: F) -> Normalized<Self, F>
    where
        Self: KeyExtractor<Keys = String>,
        F: Fn(String) -> Result<String, String> + Clone + Send + Sync + 'static,
    {
        Normalized {
            inner: self,
            normalize,
        }
    }
}

/// What the layer knows of [`KeyExtractor::Keys`] and [`KeyExtractor::Body`]: sealed,
/// so that the layer can rely on them.
mod sealed {
    use std::future::{ready, Future};

    use bytes::{Bytes, BytesMut};
    use http::Request;
    use http_body::Body;
    use http_body_util::BodyExt;

    use super::{KeyRejection, DEFAULT_BODY_LIMIT};

    /// The keys an extractor found, as the layer takes them.
    #[derive(Debug)]
    pub enum Found {
        One(String),
        Many(Vec<String>),
    }

    pub trait KeySet: Send + 'static {
        fn found(self) -> Found;
    }

    impl KeySet for String {
        fn found(self) -> Found {
            Found::One(self)
        }
    }

    impl KeySet for Vec<String> {
        fn found(self) -> Found {
            Found::Many(self)
        }
    }

    /// One key: what replay takes.
    #[diagnostic::on_unimplemented(
        message = "replay takes one key per request, and this extractor finds several",
        label = "a single-key extractor expected here",
        note = "a multi-key extractor (`json_fields`, `each`, `keys_fn`) cannot be replayed: lock its keys without `.replay()`",
        note = "see https://docs.rs/tower-redlock/latest/tower_redlock/http/replay/index.html"
    )]
    pub trait OneKey {}

    impl OneKey for String {}

    /// What an extractor reads: `()` the head, `Bytes` the body too.
    pub trait Reads: Send + Sync + 'static {
        /// The default body limit.
        const LIMIT: Option<usize>;
        /// What an extractor reading `Self` and another reading `R` read together.
        type Or<R: Reads>: Reads;
    }

    impl Reads for () {
        const LIMIT: Option<usize> = None;
        type Or<R: Reads> = R;
    }

    impl Reads for Bytes {
        const LIMIT: Option<usize> = Some(DEFAULT_BODY_LIMIT);
        type Or<R: Reads> = Bytes;
    }

    /// The head alone: what the `Locked` extractor takes.
    #[diagnostic::on_unimplemented(
        message = "this key extractor reads the request body, and `Locked` sees only the request head",
        label = "a head extractor expected here",
        note = "`Locked` takes `header`, `path_param`, `query_param`, a tuple, `each`, `keys_fn` or a closure `Fn(&Parts) -> Option<String>`; a body key (`json_field`, `json_fields`) needs a `LockLayer` on the route (and the `LayerLease` extractor)",
        note = "see https://docs.rs/tower-redlock/latest/tower_redlock/axum/index.html"
    )]
    pub trait HeadOnly {}

    impl HeadOnly for () {}

    /// Reading a request body of type `B` for an extractor that reads `Self`.
    pub trait Read<B>: Reads {
        /// The request with its body read up to `limit` bytes and put back, and the
        /// bytes; `()` reads nothing.
        fn read(
            request: Request<B>,
            limit: usize,
        ) -> impl Future<Output = Result<(Request<B>, Bytes), KeyRejection>> + Send;
    }

    impl<B: Send + 'static> Read<B> for () {
        fn read(
            request: Request<B>,
            _limit: usize,
        ) -> impl Future<Output = Result<(Request<B>, Bytes), KeyRejection>> + Send {
            ready(Ok((request, Bytes::new())))
        }
    }

    impl<B> Read<B> for Bytes
    where
        B: Body<Data = Bytes> + From<Bytes> + Send + 'static,
        B::Error: Into<crate::http::BoxError>,
    {
        async fn read(
            request: Request<B>,
            limit: usize,
        ) -> Result<(Request<B>, Bytes), KeyRejection> {
            let (parts, body) = request.into_parts();
            let declared = parts
                .headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            let too_large = |n: u64| n > u64::try_from(limit).unwrap_or(u64::MAX);
            if declared.is_some_and(too_large) || too_large(body.size_hint().lower()) {
                return Err(KeyRejection::body_too_large(limit));
            }
            let mut body = std::pin::pin!(body);
            let (mut first, mut rest) = (None::<Bytes>, BytesMut::new());
            while let Some(frame) = body.as_mut().frame().await {
                let frame = frame.map_err(|e| {
                    KeyRejection::body_unreadable(format!("reading the body failed: {}", e.into()))
                })?;
                let Ok(data) = frame.into_data() else {
                    continue; // trailers
                };
                if first.as_ref().map_or(0, Bytes::len) + rest.len() + data.len() > limit {
                    return Err(KeyRejection::body_too_large(limit));
                }
                // The common single-chunk body is passed on without a copy.
                match first.take() {
                    None if rest.is_empty() => first = Some(data),
                    first => {
                        rest.extend_from_slice(&first.unwrap_or_default());
                        rest.extend_from_slice(&data);
                    }
                }
            }
            let bytes = first.unwrap_or_else(|| rest.freeze());
            Ok((Request::from_parts(parts, B::from(bytes.clone())), bytes))
        }
    }
}

/// One key, read by a closure from the request head, e.g.
/// `|parts: &Parts| Some(parts.headers.get("x-tenant")?.to_str().ok()?.to_owned())`.
impl<F> KeyExtractor for F
where
    F: Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static,
{
    type Keys = String;
    type Body = ();

    fn keys(&self, parts: &mut Parts, _body: &[u8]) -> Result<Option<String>, KeyRejection> {
        Ok(self(parts))
    }
}

/// Checks a key against the layer's rules: not empty, at most `max_len` bytes, no
/// control characters (they have no business in an identifier and would corrupt logs).
/// Any other UTF-8 is accepted: Redis keys are binary-safe, and
/// [`Resource`](crate::Resource) escapes the parts it joins.
pub(crate) fn validate(key: &str, max_len: usize) -> Result<(), String> {
    if key.is_empty() {
        return Err("the lock key is empty".to_owned());
    }
    if key.len() > max_len {
        return Err(format!(
            "the lock key is {} bytes long, at most {max_len} are allowed",
            key.len()
        ));
    }
    if let Some((position, _)) = key.char_indices().find(|(_, c)| c.is_control()) {
        return Err(format!(
            "the lock key has a control character at byte {position}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
