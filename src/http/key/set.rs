//! Several keys per request: [`KeySetExtractor`] (what the layer takes) and
//! [`KeySetFromParts`] (what [`Locked`](crate::axum::Locked) takes), and [`Keys`], what
//! they find.
//!
//! Every single-key extractor is one of them too, answering [`Keys::One`]: the layer and
//! the extractor then take the path they always took, one resource, one lease, one
//! `Fencing-Token`. Multi-key extractors ([`json_fields`](super::json_fields),
//! [`each`](super::each), [`keys_fn`](super::keys_fn)) answer [`Keys::Many`]: every
//! key names a resource of its own, and the resources are locked together as one lease.

use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::task::{Context, Poll};

use http::request::Parts;
use http::Request;

use super::{KeyExtractor, KeyFromParts, KeyRejection, KeyResult};

/// The keys a request carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keys {
    /// The key of a single-key extractor ([`KeyExtractor`], [`KeyFromParts`]).
    One(String),
    /// The keys of a multi-key extractor, in the extractor's order. The same key twice
    /// names one resource, locked once.
    Many(Vec<String>),
}

/// What a [`KeySetExtractor`] resolves to: the request, handed back, and its keys if
/// it has any (`None`: it has none, and the layer applies
/// [`MissingKey`](crate::http::MissingKey)).
pub type KeySetResult<B> = Result<(Request<B>, Option<Keys>), KeyRejection>;

/// A boxed [`KeySetExtractor::Future`], for extractors written with `async` blocks.
pub type BoxKeySetFuture<B> = Pin<Box<dyn Future<Output = KeySetResult<B>> + Send + 'static>>;

/// Finds the lock keys of a request, possibly reading its body: what
/// [`LockLayer`](crate::http::LockLayer) takes.
///
/// Implemented by every built-in single-key extractor and every [`KeyFromParts`] (one
/// key, [`Keys::One`]), by [`single_key`] of a [`KeyExtractor`] of your own, and by the
/// multi-key extractors [`JsonFields`](super::JsonFields), [`Each`](super::Each) and
/// [`KeysFn`](super::KeysFn). Implement it for an extractor of your own that reads
/// several keys, e.g. one that parses and checks the whole body before anything is
/// locked (the orders example's transfers do).
///
/// An extractor answers `Ok(None)` when the request carries none of its keys, and
/// rejects a request that carries some and not others
/// ([`KeyRejection::missing`], naming the missing ones): a partial set cannot be locked.
/// The layer checks every key as it checks one (see [`key`](crate::http::key)).
///
/// ```
/// use bytes::Bytes;
/// use http::Request;
/// use http_body_util::{BodyExt, Full};
/// use tower_redlock::http::key::{BoxKeySetFuture, KeyRejection, KeySetExtractor, Keys};
/// use tower_redlock::http::{LockLayer, Scope};
/// use tower_redlock::Redlock;
///
/// /// Every `sku` of an order's lines, `{"lines": [{"sku": "a"}, {"sku": "b"}]}`: the
/// /// stock of each is locked, as one lease.
/// #[derive(Clone)]
/// struct Skus;
///
/// impl KeySetExtractor<Full<Bytes>> for Skus {
///     type Future = BoxKeySetFuture<Full<Bytes>>;
///
///     fn extract_keys(&self, request: Request<Full<Bytes>>) -> Self::Future {
///         Box::pin(async move {
///             let (parts, body) = request.into_parts();
///             let bytes = body
///                 .collect()
///                 .await
///                 .map_err(|e| KeyRejection::body_unreadable(e.to_string()))?
///                 .to_bytes();
///             let order: serde_json::Value = serde_json::from_slice(&bytes)
///                 .map_err(|e| KeyRejection::body_not_json(e.to_string()))?;
///             let skus: Vec<String> = order["lines"]
///                 .as_array()
///                 .into_iter()
///                 .flatten()
///                 .filter_map(|line| line["sku"].as_str().map(str::to_owned))
///                 .collect();
///             let keys = (!skus.is_empty()).then_some(Keys::Many(skus));
///             // The handler gets the same bytes.
///             Ok((Request::from_parts(parts, Full::new(bytes)), keys))
///         })
///     }
///
///     fn describe_keys(&self) -> String {
///         "the `sku` of every line of the body".to_owned()
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let request = Request::new(Full::new(Bytes::from(
///     r#"{"lines": [{"sku": "a"}, {"sku": "b"}]}"#,
/// )));
/// let (_, keys) = Skus.extract_keys(request).await.unwrap();
/// assert_eq!(keys, Some(Keys::Many(vec!["a".to_owned(), "b".to_owned()])));
/// let layer = LockLayer::new(Redlock::in_memory(), Skus).scope(Scope::shared("stock"));
/// # let _ = layer;
/// # }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a key extractor a `LockLayer` can use on `{B}` requests",
    label = "a key extractor expected here",
    note = "a `LockLayer` takes a head extractor (`header`, `path_param`, …), `json_field`/`json_fields` (for bodies that are `From<Bytes>`, as axum's `Body`), `each`/`keys_fn`, or `.replay()` over a single-key one: a multi-key extractor (`json_fields`, `each`, `keys_fn`) cannot be replayed",
    note = "see https://docs.rs/tower-redlock/latest/tower_redlock/http/index.html#several-keys-per-request and https://docs.rs/tower-redlock/latest/tower_redlock/http/replay/index.html"
)]
pub trait KeySetExtractor<B>: Clone + Send + Sync + 'static {
    /// The future [`extract_keys`](KeySetExtractor::extract_keys) returns.
    type Future: Future<Output = KeySetResult<B>> + Send;

    /// Reads the keys of `request`, and gives the request back.
    fn extract_keys(&self, request: Request<B>) -> Self::Future;

    /// What this extractor looks for, for the `detail` of a `key-missing` problem.
    fn describe_keys(&self) -> String {
        "lock keys".to_owned()
    }

    /// What key `index` of [`Keys::Many`] is, for the `detail` of a `key-invalid`
    /// problem about it (e.g. ``the body field `/to` ``).
    fn describe_key(&self, index: usize) -> String {
        format!("lock key {}", index + 1)
    }
}

/// Finds the lock keys in the request head: what [`Locked`](crate::axum::Locked)
/// takes (through [`LockKey::Extractor`](crate::axum::LockKey::Extractor)).
///
/// Implemented by every [`KeyFromParts`] (one key) and by [`Each`](super::Each) of head
/// extractors and [`KeysFn`](super::KeysFn).
///
/// ```
/// use axum::http::request::Parts;
/// use tower_redlock::axum::{LockKey, Locked};
/// use tower_redlock::http::{key::{KeyRejection, KeySetFromParts, Keys}, Scope};
///
/// /// The accounts in the `x-from` and `x-to` headers; both or neither.
/// #[derive(Clone)]
/// struct FromTo;
///
/// impl KeySetFromParts for FromTo {
///     fn keys(&self, parts: &mut Parts) -> Result<Option<Keys>, KeyRejection> {
///         let header = |name: &str| {
///             let value = parts.headers.get(name)?.to_str().ok()?;
///             Some(value.to_owned())
///         };
///         match (header("x-from"), header("x-to")) {
///             (Some(from), Some(to)) => Ok(Some(Keys::Many(vec![from, to]))),
///             (None, None) => Ok(None),
///             _ => Err(KeyRejection::missing("no lock key: both `x-from` and `x-to` are needed")),
///         }
///     }
/// }
///
/// struct Accounts;
///
/// impl LockKey for Accounts {
///     type Extractor = FromTo;
///
///     fn extractor() -> FromTo {
///         FromTo
///     }
///
///     fn scope() -> Scope {
///         Scope::shared("account")
///     }
/// }
///
/// async fn transfer(accounts: Locked<Accounts>) -> String {
///     format!("{} accounts locked", accounts.resources().len())
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not find its keys in the request head, as `Locked`'s extractor must",
    label = "a head extractor expected here",
    note = "`Locked` sees only the request head: use `header`, `path_param`, `query_param`, a tuple, `each`, `keys_fn` or a closure `Fn(&Parts) -> Option<String>`; a body key (`json_field`, `json_fields`) needs a `LockLayer` on the route (and the `LayerLease` extractor)",
    note = "see https://docs.rs/tower-redlock/latest/tower_redlock/axum/index.html"
)]
pub trait KeySetFromParts: Clone + Send + Sync + 'static {
    /// The keys of the request with head `parts`: `Ok(None)` when it has none.
    fn keys(&self, parts: &mut Parts) -> Result<Option<Keys>, KeyRejection>;

    /// What this extractor looks for (see [`KeySetExtractor::describe_keys`]).
    fn describe_keys(&self) -> String {
        "lock keys".to_owned()
    }

    /// What key `index` of [`Keys::Many`] is (see [`KeySetExtractor::describe_key`]).
    fn describe_key(&self, index: usize) -> String {
        format!("lock key {}", index + 1)
    }
}

impl<K: KeyFromParts> KeySetFromParts for K {
    fn keys(&self, parts: &mut Parts) -> Result<Option<Keys>, KeyRejection> {
        Ok(self.key(parts)?.map(Keys::One))
    }

    fn describe_keys(&self) -> String {
        KeyFromParts::describe(self)
    }

    fn describe_key(&self, _index: usize) -> String {
        KeyFromParts::describe(self)
    }
}

impl<K, B> KeySetExtractor<B> for K
where
    K: KeyFromParts,
    B: Send + 'static,
{
    type Future = OneKey<Ready<KeyResult<B>>>;

    fn extract_keys(&self, request: Request<B>) -> Self::Future {
        OneKey {
            extracting: KeyExtractor::extract(self, request),
        }
    }

    fn describe_keys(&self) -> String {
        KeyFromParts::describe(self)
    }

    fn describe_key(&self, _index: usize) -> String {
        KeyFromParts::describe(self)
    }
}

/// A single-key [`KeyExtractor`] of your own as a [`KeySetExtractor`], for
/// [`LockLayer`](crate::http::LockLayer): `LockLayer::new(locker, single_key(MyKey))`.
/// Every built-in extractor and every [`KeyFromParts`] is one already.
///
/// (The layer takes [`KeySetExtractor`]s. Coherence forbids implementing it for every
/// [`KeyExtractor<B>`] and for the multi-key extractors at once: another crate could
/// make a multi-key extractor a [`KeyExtractor`] of its own body type.)
///
/// ```
/// use http::Request;
/// use tower_redlock::http::{key::{single_key, KeyExtractor, KeyResult}, LockLayer};
/// use tower_redlock::Redlock;
///
/// /// The key is the request's method (a stand-in for a key read from the body).
/// #[derive(Clone)]
/// struct MethodKey;
///
/// impl<B: Send + 'static> KeyExtractor<B> for MethodKey {
///     type Future = std::future::Ready<KeyResult<B>>;
///
///     fn extract(&self, request: Request<B>) -> Self::Future {
///         let key = request.method().to_string();
///         std::future::ready(Ok((request, Some(key))))
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let layer = LockLayer::new(Redlock::in_memory(), single_key(MethodKey));
/// # let _ = layer;
/// # }
/// ```
pub fn single_key<K>(extractor: K) -> SingleKey<K> {
    SingleKey { extractor }
}

/// A [`KeyExtractor`] as a [`KeySetExtractor`]; see [`single_key`].
#[derive(Debug, Clone)]
pub struct SingleKey<K> {
    extractor: K,
}

impl<K> SingleKey<K> {
    /// The extractor.
    pub fn get_ref(&self) -> &K {
        &self.extractor
    }
}

impl<K, B> KeyExtractor<B> for SingleKey<K>
where
    K: KeyExtractor<B>,
{
    type Future = K::Future;

    fn extract(&self, request: Request<B>) -> Self::Future {
        self.extractor.extract(request)
    }

    fn describe(&self) -> String {
        self.extractor.describe()
    }
}

impl<K, B> KeySetExtractor<B> for SingleKey<K>
where
    K: KeyExtractor<B>,
{
    type Future = OneKey<K::Future>;

    fn extract_keys(&self, request: Request<B>) -> Self::Future {
        OneKey::new(self.extractor.extract(request))
    }

    fn describe_keys(&self) -> String {
        self.extractor.describe()
    }

    fn describe_key(&self, _index: usize) -> String {
        self.extractor.describe()
    }
}

/// The [`KeySetExtractor::Future`] of a single-key extractor: its own future, its key
/// answered as [`Keys::One`]. No allocation: a one-key request costs what it always did.
#[pin_project::pin_project]
#[derive(Debug)]
pub struct OneKey<F> {
    #[pin]
    extracting: F,
}

impl<F> OneKey<F> {
    /// The key of `extracting`, answered as [`Keys::One`].
    pub fn new(extracting: F) -> Self {
        OneKey { extracting }
    }
}

impl<F, B> Future for OneKey<F>
where
    F: Future<Output = KeyResult<B>>,
{
    type Output = KeySetResult<B>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project()
            .extracting
            .poll(cx)
            .map(|result| result.map(|(request, key)| (request, key.map(Keys::One))))
    }
}

/// A [`KeySetFromParts`] as a [`KeySetExtractor`], for the multi-key head extractors:
/// the head is read, the request handed back at once.
pub(crate) fn from_parts<E, B>(extractor: &E, request: Request<B>) -> Ready<KeySetResult<B>>
where
    E: KeySetFromParts,
{
    let (mut parts, body) = request.into_parts();
    ready(
        extractor
            .keys(&mut parts)
            .map(|keys| (Request::from_parts(parts, body), keys)),
    )
}

/// The keys of several members, each `None` when the request lacks it: all absent is no
/// key (`Ok(None)`), some absent is a request the layer cannot lock (400 `key-missing`,
/// naming them), all present is [`Keys::Many`].
pub(crate) fn gather(
    found: Vec<Option<String>>,
    describe: impl Fn(usize) -> String,
) -> Result<Option<Keys>, KeyRejection> {
    let missing: Vec<String> = found
        .iter()
        .enumerate()
        .filter(|(_, key)| key.is_none())
        .map(|(index, _)| describe(index))
        .collect();
    if missing.len() == found.len() {
        return Ok(None);
    }
    if !missing.is_empty() {
        return Err(KeyRejection::missing(format!(
            "no lock key: expected {}",
            missing.join(" and ")
        )));
    }
    Ok(Some(Keys::Many(found.into_iter().flatten().collect())))
}
