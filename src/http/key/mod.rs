//! Where the lock key of a request comes from.
//!
//! Two traits:
//!
//! - [`KeyFromParts`] reads the key from the request head (method, URI, headers,
//!   extensions). It is synchronous, composes (tuples, [`or`](KeyFromParts::or)), and
//!   every closure `Fn(&Parts) -> Option<String>` is one.
//! - [`KeyExtractor`] is what [`LockLayer`](super::LockLayer) takes: it gets the whole
//!   request and hands it back, so it may look into the body. Every
//!   [`KeyFromParts`] is a [`KeyExtractor`]; [`JsonField`] is the body-aware one.
//!
//! Built-ins: [`header`], [`query_param`], `path_param` (feature `axum`),
//! [`json_field`], and the [`webhook`] presets.
//!
//! Several keys per request, each a resource of its own, locked together as one lease:
//! [`KeySetExtractor`] (what the layer takes: every single-key extractor is one, and so
//! are [`json_fields`], [`each`] and [`keys_fn`]) and [`KeySetFromParts`] (the head-only
//! form the `Locked` extractor takes). See [below](self#several-keys).
//!
//! An extractor answers `Ok(Some(key))`, `Ok(None)` when the request carries no key
//! (the layer then applies [`MissingKey`](super::MissingKey)), or a [`KeyRejection`]
//! when the request is malformed. Ambiguous keys are rejected rather than guessed: a
//! header or query parameter that appears twice could make the lock protect one value
//! while the handler reads the other.
//!
//! The layer then checks the key: not empty, at most
//! [`max_key_len`](super::LockLayer::max_key_len) bytes of UTF-8, no control
//! characters. Anything else is a valid key, including spaces and non-ASCII letters
//! (a percent-decoded path id such as `/accounts/%C3%A9` gives `é`).
//!
//! # Several keys
//!
//! A multi-key extractor answers [`Keys::Many`]. A request with none of its keys has no
//! key (the layer's [`MissingKey`](super::MissingKey) decides); one with some and not
//! others is refused with 400 `key-missing` naming the missing ones. Every key is
//! checked as one is, and a refusal names the key (``the body field `/to` ``); keys
//! naming the same resource are one; more distinct keys than
//! [`MAX_RESOURCES_PER_LEASE`](crate::MAX_RESOURCES_PER_LEASE) get 400
//! `key-invalid`. Nothing is locked for any of these.
//!
//! A key the server cannot find because it is configured wrongly — a
//! `path_param` name that the matched route does not have — is not the client's
//! fault: it is answered with 500 `key-misconfigured` and logged as an error.

mod each;
mod header;
mod json;
#[cfg(feature = "axum")]
mod path;
mod query;
mod rejection;
mod set;
pub mod webhook;

use std::fmt;
use std::future::{ready, Future, Ready};
use std::pin::Pin;

use http::request::Parts;
use http::Request;

use crate::Resource;

pub use each::{each, keys_fn, Each, KeysFn};
pub use header::{header, Header};
pub(crate) use json::read_limited;
pub use json::{json_field, json_fields, JsonField, JsonFields, DEFAULT_BODY_LIMIT};
#[cfg(feature = "axum")]
pub use path::{path_param, PathParam};
pub use query::{query_param, QueryParam};
pub use rejection::KeyRejection;
pub use set::{single_key, SingleKey};
pub use set::{BoxKeySetFuture, KeySetExtractor, KeySetFromParts, KeySetResult, Keys, OneKey};

/// What a [`KeyExtractor`] resolves to: the request, handed back, and its key if it has one.
pub type KeyResult<B> = Result<(Request<B>, Option<String>), KeyRejection>;

/// A boxed [`KeyExtractor::Future`], for extractors written with `async` blocks.
pub type BoxKeyFuture<B> = Pin<Box<dyn Future<Output = KeyResult<B>> + Send + 'static>>;

/// Finds the lock key of a request, possibly reading its body.
///
/// Implement [`KeyFromParts`] instead when the request head is enough: every
/// [`KeyFromParts`] is a [`KeyExtractor`] for any body type.
///
/// An extractor that reads the body must hand the request on with a body that yields
/// the same bytes, as [`JsonField`] does.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a single-key extractor for `{B}` requests",
    label = "one key per request expected here",
    note = "replay (`LockLayer::replay`) takes a single-key extractor (`header`, `path_param`, `query_param`, `json_field`, a tuple, a closure `Fn(&Parts) -> Option<String>`); a multi-key extractor (`json_fields`, `each`, `keys_fn`) cannot be replayed: lock its keys without `.replay()`",
    note = "body extractors (`json_field`) need a body that is `From<Bytes>` with `Bytes` data, as axum's `Body`",
    note = "see https://docs.rs/tower-redlock/latest/tower_redlock/http/key/index.html"
)]
pub trait KeyExtractor<B>: Clone + Send + Sync + 'static {
    /// The future [`extract`](KeyExtractor::extract) returns.
    type Future: Future<Output = KeyResult<B>> + Send;

    /// Reads the key of `request`, and gives the request back.
    fn extract(&self, request: Request<B>) -> Self::Future;

    /// What this extractor looks for, for the `detail` of a `key-missing` problem,
    /// e.g. ``the `idempotency-key` header``.
    fn describe(&self) -> String {
        "a lock key".to_owned()
    }
}

/// Finds the lock key in the request head.
///
/// Implemented by the built-in head extractors, by tuples of up to four of them (all
/// parts required, joined so that `("ab", "c")` and `("a", "bc")` stay distinct), and by
/// closures:
///
/// ```
/// use http::request::Parts;
/// use tower_redlock::http::LockLayer;
/// use tower_redlock::Redlock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let tenant_and_key = |parts: &Parts| {
///     let tenant = parts.headers.get("x-tenant")?.to_str().ok()?;
///     let key = parts.headers.get("idempotency-key")?.to_str().ok()?;
///     Some(format!("{tenant}/{key}"))
/// };
/// let layer = LockLayer::new(Redlock::in_memory(), tenant_and_key);
/// # let _ = layer;
/// # }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not find a key in the request head",
    label = "a head extractor expected here",
    note = "use `header`, `path_param`, `query_param`, a tuple or `Or` of them, or a closure `Fn(&Parts) -> Option<String>`; a body key (`json_field`) needs a `LockLayer`, which reads the body",
    note = "see https://docs.rs/tower-redlock/latest/tower_redlock/http/key/index.html"
)]
pub trait KeyFromParts: Clone + Send + Sync + 'static {
    /// The key of the request with head `parts`: `Ok(None)` when it has none.
    fn key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection>;

    /// What this extractor looks for (see [`KeyExtractor::describe`]).
    fn describe(&self) -> String {
        "a lock key".to_owned()
    }

    /// This extractor, falling back to `fallback` when it finds no key. A rejection of
    /// the first extractor is not overruled by the fallback.
    fn or<F: KeyFromParts>(self, fallback: F) -> Or<Self, F>
    where
        Self: Sized,
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
    ///
    /// ```
    /// use tower_redlock::http::{key::{path_param, KeyFromParts}, LockLayer};
    /// use tower_redlock::Redlock;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let layer = LockLayer::new(Redlock::in_memory(), path_param("id").parse::<u64>());
    /// # let _ = layer;
    /// # }
    /// ```
    fn parse<T>(self) -> Normalized<Self, NormalizeFn>
    where
        Self: Sized,
        T: std::str::FromStr + fmt::Display + 'static,
    {
        self.normalize(canonical::<T>)
    }

    /// This extractor's key passed through `normalize`, which returns the key to lock
    /// (e.g. a UUID in lower case) or why the key is not acceptable (400 `key-invalid`,
    /// with the reason in the problem's detail).
    ///
    /// ```
    /// use tower_redlock::http::{key::{path_param, KeyFromParts}, LockLayer};
    /// use tower_redlock::Redlock;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// // One order whatever the case of its UUID.
    /// let key = path_param("id").normalize(|id: String| Ok(id.to_ascii_lowercase()));
    /// let layer = LockLayer::new(Redlock::in_memory(), key);
    /// # let _ = layer;
    /// # }
    /// ```
    fn normalize<F>(self, normalize: F) -> Normalized<Self, F>
    where
        Self: Sized,
        F: Fn(String) -> Result<String, String> + Clone + Send + Sync + 'static,
    {
        Normalized {
            inner: self,
            normalize,
        }
    }
}

/// The normalising function of [`KeyFromParts::parse`]: the key to lock, or why the
/// key is refused.
pub type NormalizeFn = fn(String) -> Result<String, String>;

/// `key` parsed as `T`, written back in `T`'s own form.
fn canonical<T: std::str::FromStr + fmt::Display>(key: String) -> Result<String, String> {
    match key.parse::<T>() {
        Ok(value) => Ok(value.to_string()),
        Err(_) => Err(format!(
            "`{key}` is not a valid {}",
            std::any::type_name::<T>()
                .rsplit("::")
                .next()
                .unwrap_or("value")
        )),
    }
}

/// A key passed through a normalising function; see [`KeyFromParts::normalize`] and
/// [`KeyFromParts::parse`].
#[derive(Clone)]
pub struct Normalized<E, F> {
    inner: E,
    normalize: F,
}

impl<E: fmt::Debug, F> fmt::Debug for Normalized<E, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Normalized")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<E, F> KeyFromParts for Normalized<E, F>
where
    E: KeyFromParts,
    F: Fn(String) -> Result<String, String> + Clone + Send + Sync + 'static,
{
    fn key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
        match self.inner.key(parts)? {
            None => Ok(None),
            Some(key) => (self.normalize)(key).map(Some).map_err(|detail| {
                KeyRejection::invalid(format!("{}: {detail}", self.inner.describe()))
            }),
        }
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

impl<K, B> KeyExtractor<B> for K
where
    K: KeyFromParts,
    B: Send + 'static,
{
    type Future = Ready<KeyResult<B>>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        ready(
            self.key(&mut parts)
                .map(|key| (Request::from_parts(parts, body), key)),
        )
    }

    fn describe(&self) -> String {
        KeyFromParts::describe(self)
    }
}

impl<F> KeyFromParts for F
where
    F: Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static,
{
    fn key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
        Ok(self(parts))
    }
}

/// Checks a key against the layer's rules: not empty, at most `max_len` bytes, no
/// control characters.
///
/// Any other UTF-8 is accepted (a percent-decoded path id such as `é`, a space in a
/// quoted `Idempotency-Key`): Redis keys are binary-safe, and [`Resource`] escapes the
/// parts it joins, so no key can reach into another part. Control characters are
/// refused because they have no business in an identifier and would corrupt logs.
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

// ---------------------------------------------------------------------------------
// Combinators

/// One extractor with a fallback; see [`KeyFromParts::or`].
#[derive(Debug, Clone)]
pub struct Or<A, F> {
    first: A,
    fallback: F,
}

impl<A: KeyFromParts, F: KeyFromParts> KeyFromParts for Or<A, F> {
    fn key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
        match self.first.key(parts)? {
            Some(key) => Ok(Some(key)),
            None => self.fallback.key(parts),
        }
    }

    fn describe(&self) -> String {
        format!("{} or {}", self.first.describe(), self.fallback.describe())
    }
}

macro_rules! tuple_key {
    ($($name:ident),+) => {
        /// All parts are required; they are joined with [`Resource`] escaping, so
        /// different part lists never give the same key. An empty part is rejected.
        impl<$($name: KeyFromParts),+> KeyFromParts for ($($name,)+) {
            #[allow(non_snake_case)]
            fn key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
                let ($($name,)+) = self;
                let mut joined: Option<Resource> = None;
                let mut missing = false;
                $(
                    match $name.key(parts)? {
                        None => missing = true,
                        Some(part) if part.is_empty() => {
                            return Err(KeyRejection::invalid(format!(
                                "{} is empty",
                                $name.describe()
                            )));
                        }
                        Some(part) => {
                            joined = Some(match joined {
                                None => Resource::new(part),
                                Some(r) => r.join(part),
                            });
                        }
                    }
                )+
                if missing {
                    return Ok(None);
                }
                Ok(joined.map(|r| r.as_str().to_owned()))
            }

            #[allow(non_snake_case)]
            fn describe(&self) -> String {
                let ($($name,)+) = self;
                [$($name.describe()),+].join(" and ")
            }
        }
    };
}

tuple_key!(K1, K2);
tuple_key!(K1, K2, K3);
tuple_key!(K1, K2, K3, K4);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::problem::ProblemKind;
    use bytes::Bytes;
    use http::Method;
    use http_body_util::BodyExt;

    fn parts(uri: &str, headers: &[(&str, &[u8])]) -> Parts {
        let mut builder = Request::builder().method(Method::POST).uri(uri);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    #[test]
    fn validation() {
        assert!(validate("abc-123_~!", 255).is_ok());
        assert!(validate("", 255).is_err());
        assert!(validate(&"a".repeat(255), 255).is_ok());
        assert!(validate(&"a".repeat(256), 255).is_err());
        for good in ["a b", "é", "\u{fffd}", "日本", "\"quoted\""] {
            assert!(validate(good, 255).is_ok(), "{good:?}");
        }
        for bad in ["a\tb", "a\nb", "\0", "a\u{7f}", "a\u{85}"] {
            assert!(validate(bad, 255).is_err(), "{bad:?}");
        }
        // The limit counts bytes, not characters.
        assert!(validate(&"é".repeat(128), 255).is_err());
    }

    #[test]
    fn header_values() {
        let key = header("Idempotency-Key");
        assert_eq!(key.name(), "idempotency-key");
        assert_eq!(key.key(&mut parts("/", &[])).unwrap(), None);
        assert_eq!(
            key.key(&mut parts("/", &[("idempotency-key", b"k1")]))
                .unwrap()
                .as_deref(),
            Some("k1")
        );
        let twice = key
            .key(&mut parts(
                "/",
                &[("idempotency-key", b"a"), ("idempotency-key", b"b")],
            ))
            .unwrap_err();
        assert_eq!(twice.kind(), ProblemKind::KeyInvalid);
        // Bytes that are not UTF-8 are refused, never folded into U+FFFD (two values
        // would then name one lock); UTF-8 is a key like any other.
        let odd = key
            .key(&mut parts("/", &[("idempotency-key", b"a\xffb")]))
            .unwrap_err();
        assert_eq!(odd.kind(), ProblemKind::KeyInvalid);
        assert_eq!(
            key.key(&mut parts("/", &[("idempotency-key", "é".as_bytes())]))
                .unwrap()
                .as_deref(),
            Some("é")
        );
    }

    #[test]
    fn idempotency_keys_are_structured_field_strings() {
        let key = header("Idempotency-Key");
        let get = |value: &str| key.key(&mut parts("/", &[("idempotency-key", value.as_bytes())]));
        assert_eq!(
            get(r#""8e03978e-40d5""#).unwrap().as_deref(),
            Some("8e03978e-40d5")
        );
        assert_eq!(
            get("8e03978e-40d5").unwrap().as_deref(),
            Some("8e03978e-40d5")
        );
        assert_eq!(
            get(r#""a \"b\" \\c""#).unwrap().as_deref(),
            Some(r#"a "b" \c"#)
        );
        assert_eq!(get(r#""""#).unwrap().as_deref(), Some(""));
        for bad in [r#"""#, r#""abc"#, r#""a"b"#, r#""a\b""#, r#""a\""#, "\"é\""] {
            assert_eq!(
                get(bad).unwrap_err().kind(),
                ProblemKind::KeyInvalid,
                "{bad}"
            );
        }
        // Other headers are taken as they are, unless asked.
        let other = |h: Header| {
            h.key(&mut parts("/", &[("x-key", br#""k""#)]))
                .unwrap()
                .unwrap()
        };
        assert_eq!(other(header("x-key")), r#""k""#);
        assert_eq!(other(header("x-key").sf_string(true)), "k");
        assert_eq!(
            header("Idempotency-Key")
                .sf_string(false)
                .key(&mut parts("/", &[("idempotency-key", br#""k""#)]))
                .unwrap()
                .as_deref(),
            Some(r#""k""#)
        );
    }

    #[test]
    #[should_panic(expected = "invalid header name")]
    fn bad_header_names_panic() {
        let _ = header("not a header");
    }

    #[test]
    fn query_params() {
        let key = query_param("key");
        let get = |uri: &str| key.key(&mut parts(uri, &[]));
        assert_eq!(get("/").unwrap(), None);
        assert_eq!(get("/?other=1").unwrap(), None);
        assert_eq!(get("/?a=1&key=x%2Fy&b").unwrap().as_deref(), Some("x/y"));
        assert_eq!(get("/?k%65y=v").unwrap().as_deref(), Some("v"));
        assert_eq!(get("/?key").unwrap().as_deref(), Some(""));
        assert_eq!(get("/?key=a+b").unwrap().as_deref(), Some("a b"));
        assert_eq!(get("/?key=100%").unwrap().as_deref(), Some("100%"));
        assert_eq!(
            get("/?key=1&key=2").unwrap_err().kind(),
            ProblemKind::KeyInvalid
        );
        assert_eq!(
            get("/?key=%FF").unwrap_err().kind(),
            ProblemKind::KeyInvalid
        );
    }

    #[test]
    fn tuples_join_without_collisions() {
        let pair = (header("a"), header("b"));
        let key = |a: &str, b: &str| {
            pair.key(&mut parts("/", &[("a", a.as_bytes()), ("b", b.as_bytes())]))
                .unwrap()
                .unwrap()
        };
        assert_ne!(key("ab", "c"), key("a", "bc"));
        assert_ne!(key("a:b", "c"), key("a", "b:c"));
        assert_eq!(key("ab", "c"), "ab:c");
        assert_eq!(pair.key(&mut parts("/", &[("a", b"x")])).unwrap(), None);
        let empty = pair
            .key(&mut parts("/", &[("a", b""), ("b", b"x")]))
            .unwrap_err();
        assert_eq!(empty.kind(), ProblemKind::KeyInvalid);

        let triple = (header("a"), header("b"), query_param("c"));
        assert_eq!(
            triple
                .key(&mut parts("/?c=3", &[("a", b"1"), ("b", b"2")]))
                .unwrap()
                .as_deref(),
            Some("1:2:3")
        );
        assert_eq!(
            KeyFromParts::describe(&triple),
            "the `a` header and the `b` header and the `c` query parameter"
        );
    }

    #[test]
    fn closures_and_fallbacks() {
        let method = |parts: &Parts| Some(parts.method.to_string());
        assert_eq!(
            method.key(&mut parts("/", &[])).unwrap().as_deref(),
            Some("POST")
        );
        let shopify = webhook::shopify();
        let get = |headers: &[(&str, &[u8])]| shopify.key(&mut parts("/", headers)).unwrap();
        assert_eq!(get(&[]), None);
        assert_eq!(get(&[("x-shopify-webhook-id", b"w")]).as_deref(), Some("w"));
        assert_eq!(
            get(&[("x-shopify-webhook-id", b"w"), ("x-shopify-event-id", b"e")]).as_deref(),
            Some("e")
        );
        assert_eq!(
            webhook::github()
                .key(&mut parts("/", &[("X-GitHub-Delivery", b"d")]))
                .unwrap()
                .as_deref(),
            Some("d")
        );
    }

    #[tokio::test]
    async fn json_fields() {
        let field = json_field("/data/id");
        let extract = |body: &'static str| {
            let request = Request::new(http_body_util::Full::new(Bytes::from(body)));
            KeyExtractor::extract(&field, request)
        };
        let (request, key) = extract(r#"{"data":{"id":"evt_1"}}"#).await.unwrap();
        assert_eq!(key.as_deref(), Some("evt_1"));
        let body = request.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, r#"{"data":{"id":"evt_1"}}"#);
        assert_eq!(
            extract(r#"{"data":{"id":42}}"#).await.unwrap().1.as_deref(),
            Some("42")
        );
        assert_eq!(
            extract(r#"{"data":{"id":-1.5}}"#)
                .await
                .unwrap()
                .1
                .as_deref(),
            Some("-1.5")
        );
        assert_eq!(extract(r#"{"data":{"id":null}}"#).await.unwrap().1, None);
        assert_eq!(extract(r#"{"data":{}}"#).await.unwrap().1, None);
        assert_eq!(extract(r#"[1]"#).await.unwrap().1, None);
        assert_eq!(
            extract(r#"{"data":{"id":true}}"#).await.unwrap_err().kind(),
            ProblemKind::KeyInvalid
        );
        assert_eq!(
            extract("id=1").await.unwrap_err().kind(),
            ProblemKind::BodyNotJson
        );
        assert_eq!(
            extract("").await.unwrap_err().kind(),
            ProblemKind::BodyNotJson
        );
    }

    #[tokio::test]
    async fn json_bodies_over_the_limit() {
        let field = json_field("/id").limit(8);
        // Known size: refused before reading.
        let request = Request::new(http_body_util::Full::new(Bytes::from(r#"{"id":"123456"}"#)));
        let err = KeyExtractor::extract(&field, request).await.unwrap_err();
        assert_eq!(err.kind(), ProblemKind::BodyTooLarge);
        // Unknown size: refused while reading.
        let chunks =
            futures_util::stream::iter(["{\"id\"", ":\"1234", "56\"}"].map(|c| {
                Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from(c)))
            }));
        let request = Request::new(http_body_util::StreamBody::new(chunks));
        let (parts, body) = request.into_parts();
        let err = read_limited(body, 8).await.unwrap_err();
        assert_eq!(err.kind(), ProblemKind::BodyTooLarge);
        drop(parts);
        // Several chunks within the limit are joined.
        let chunks =
            futures_util::stream::iter(["{\"id\"", ":1}"].map(|c| {
                Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from(c)))
            }));
        let bytes = read_limited(http_body_util::StreamBody::new(chunks), 64)
            .await
            .unwrap();
        assert_eq!(bytes, "{\"id\":1}");
    }

    #[test]
    #[should_panic(expected = "JSON Pointer")]
    fn bad_pointers_panic() {
        let _ = json_field("id");
    }
}
