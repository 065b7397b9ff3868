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
//! A key the server cannot find because it is configured wrongly — a
//! `path_param` name that the matched route does not have — is not the client's
//! fault: it is answered with 500 `key-misconfigured` and logged as an error.

use std::fmt;
use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, CONTENT_LENGTH};
use http::request::Parts;
use http::Request;
use http_body::Body;
use http_body_util::BodyExt;

use super::problem::{Problem, ProblemKind};
use crate::lock::Resource;

/// What a [`KeyExtractor`] resolves to: the request, handed back, and its key if it has one.
pub type KeyResult<B> = Result<(Request<B>, Option<String>), KeyRejection>;

/// A boxed [`KeyExtractor::Future`], for extractors written with `async` blocks.
pub type BoxKeyFuture<B> = Pin<Box<dyn Future<Output = KeyResult<B>> + Send + 'static>>;

/// Errors that body readers may return.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Finds the lock key of a request, possibly reading its body.
///
/// Implement [`KeyFromParts`] instead when the request head is enough: every
/// [`KeyFromParts`] is a [`KeyExtractor`] for any body type.
///
/// An extractor that reads the body must hand the request on with a body that yields
/// the same bytes, as [`JsonField`] does.
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

/// Why a request's key could not be read: a malformed request. The layer answers with
/// the matching [`Problem`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRejection {
    kind: ProblemKind,
    detail: String,
}

impl KeyRejection {
    /// The key is present but unusable (ambiguous, wrong type, not UTF-8): 400 `key-invalid`.
    pub fn invalid(detail: impl Into<String>) -> Self {
        KeyRejection {
            kind: ProblemKind::KeyInvalid,
            detail: detail.into(),
        }
    }

    /// The server is configured to look for a key where the request cannot have one
    /// (a path parameter the matched route does not have): 500 `key-misconfigured`.
    pub fn misconfigured(detail: impl Into<String>) -> Self {
        KeyRejection {
            kind: ProblemKind::KeyMisconfigured,
            detail: detail.into(),
        }
    }

    /// The body exceeds `limit` bytes: 413 `body-too-large`.
    pub fn body_too_large(limit: usize) -> Self {
        KeyRejection {
            kind: ProblemKind::BodyTooLarge,
            detail: format!(
                "the body is larger than {limit} bytes, the limit for finding its lock key"
            ),
        }
    }

    /// The body should be JSON and is not: 400 `body-not-json`.
    pub fn body_not_json(detail: impl Into<String>) -> Self {
        KeyRejection {
            kind: ProblemKind::BodyNotJson,
            detail: detail.into(),
        }
    }

    /// Reading the body failed: 400 `body-unreadable`.
    pub fn body_unreadable(detail: impl Into<String>) -> Self {
        KeyRejection {
            kind: ProblemKind::BodyUnreadable,
            detail: detail.into(),
        }
    }

    /// A rejection of `kind` explained by `detail` (for the layer's own body readers).
    pub(crate) fn with_kind(kind: ProblemKind, detail: impl Into<String>) -> Self {
        KeyRejection {
            kind,
            detail: detail.into(),
        }
    }

    /// The problem type this rejection is answered with.
    pub fn kind(&self) -> ProblemKind {
        self.kind
    }

    /// The explanation given to the client.
    pub fn detail(&self) -> &str {
        &self.detail
    }
}

impl fmt::Display for KeyRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.detail)
    }
}

impl std::error::Error for KeyRejection {}

impl From<KeyRejection> for Problem {
    fn from(rejection: KeyRejection) -> Self {
        Problem::new(rejection.kind, rejection.detail)
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
// Header

/// The key is the value of a request header; see [`header`].
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
    sf_string: bool,
}

/// The key is the value of the header `name` (e.g. `Idempotency-Key`). A header sent
/// twice, or a value that is not UTF-8, is rejected (`key-invalid`).
///
/// For `Idempotency-Key` the value is read as the IETF draft defines it, an
/// [RFC 8941](https://www.rfc-editor.org/rfc/rfc8941#name-strings) *String*:
/// `"8e03978e-40d5"` gives the key `8e03978e-40d5` (the quotes are syntax, `\"` and
/// `\\` are escapes), and a bare value as Stripe's clients send it (`8e03978e-40d5`)
/// is taken as it is; a value that opens a quote but is not a valid String is
/// rejected (`key-invalid`). [`Header::sf_string`] turns this reading on or off for any
/// header.
///
/// ```
/// use tower_redlock::http::{header, KeyFromParts};
///
/// let request = http::Request::post("/payments")
///     .header("Idempotency-Key", r#""8e03978e-40d5""#)
///     .body(())
///     .unwrap();
/// let (mut parts, ()) = request.into_parts();
/// let key = header("Idempotency-Key").key(&mut parts).unwrap();
/// assert_eq!(key.as_deref(), Some("8e03978e-40d5"));
/// ```
///
/// # Panics
///
/// When `name` is not a valid header name.
pub fn header<N>(name: N) -> Header
where
    N: TryInto<HeaderName>,
    N::Error: fmt::Display,
{
    match name.try_into() {
        Ok(name) => {
            let sf_string = name == IDEMPOTENCY_KEY;
            Header { name, sf_string }
        }
        Err(e) => panic!("invalid header name for a lock key: {e}"),
    }
}

/// The header of the IETF draft *The Idempotency-Key HTTP Header Field*.
const IDEMPOTENCY_KEY: &str = "idempotency-key";

impl Header {
    /// The header's name.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }

    /// Reads the value as an RFC 8941 String when it starts with a double quote, else
    /// as it is (default: on for `Idempotency-Key`, off for other headers).
    #[must_use]
    pub fn sf_string(mut self, on: bool) -> Self {
        self.sf_string = on;
        self
    }
}

/// The content of the RFC 8941 String `value` (which starts with `"`), or why it is
/// not one.
fn parse_sf_string(value: &str) -> Result<String, &'static str> {
    let mut chars = value.chars();
    if chars.next() != Some('"') {
        return Err("a String starts with a double quote");
    }
    let mut out = String::with_capacity(value.len());
    loop {
        match chars.next() {
            None => return Err("the closing double quote is missing"),
            Some('"') => break,
            Some('\\') => match chars.next() {
                Some(c @ ('"' | '\\')) => out.push(c),
                _ => return Err("only \\\" and \\\\ may be escaped"),
            },
            Some(c @ ' '..='~') => out.push(c),
            Some(_) => return Err("a String holds visible ASCII and spaces only"),
        }
    }
    if chars.next().is_some() {
        return Err("characters follow the closing double quote");
    }
    Ok(out)
}

impl KeyFromParts for Header {
    fn key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
        let mut values = parts.headers.get_all(&self.name).iter();
        match (values.next(), values.next()) {
            (None, _) => Ok(None),
            (Some(value), None) => {
                // Refused rather than replaced with U+FFFD: two different byte strings
                // must never name one lock.
                let text = std::str::from_utf8(value.as_bytes()).map_err(|_| {
                    KeyRejection::invalid(format!("the `{}` header is not UTF-8", self.name))
                })?;
                if self.sf_string && text.starts_with('"') {
                    return parse_sf_string(text).map(Some).map_err(|why| {
                        KeyRejection::invalid(format!(
                            "the `{}` header is not a valid structured-field String (RFC 8941): {why}",
                            self.name
                        ))
                    });
                }
                Ok(Some(text.to_owned()))
            }
            (Some(_), Some(_)) => Err(KeyRejection::invalid(format!(
                "the `{}` header appears more than once",
                self.name
            ))),
        }
    }

    fn describe(&self) -> String {
        format!("the `{}` header", self.name)
    }
}

// ---------------------------------------------------------------------------------
// Query parameter

/// The key is a query parameter; see [`query_param`].
#[derive(Debug, Clone)]
pub struct QueryParam {
    name: Arc<str>,
}

/// The key is the query parameter `name`, percent-decoded (`+` is a space). A
/// parameter given twice is rejected (`key-invalid`).
pub fn query_param(name: impl Into<Arc<str>>) -> QueryParam {
    QueryParam { name: name.into() }
}

impl KeyFromParts for QueryParam {
    fn key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
        let Some(query) = parts.uri.query() else {
            return Ok(None);
        };
        let mut found = None;
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            if decode_component(name).as_deref() != Some(&*self.name) {
                continue;
            }
            if found.is_some() {
                return Err(KeyRejection::invalid(format!(
                    "the `{}` query parameter appears more than once",
                    self.name
                )));
            }
            let value = decode_component(value).ok_or_else(|| {
                KeyRejection::invalid(format!("the `{}` query parameter is not UTF-8", self.name))
            })?;
            found = Some(value);
        }
        Ok(found)
    }

    fn describe(&self) -> String {
        format!("the `{}` query parameter", self.name)
    }
}

/// Decodes one `application/x-www-form-urlencoded` component; `None` if not UTF-8.
/// A `%` not followed by two hex digits stays as it is.
fn decode_component(input: &str) -> Option<String> {
    let bytes = input.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = bytes.get(i + 1..i + 3).and_then(|h| {
                    let h = std::str::from_utf8(h).ok()?;
                    u8::from_str_radix(h, 16).ok()
                });
                match hex {
                    Some(byte) => {
                        out.push(byte);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

// ---------------------------------------------------------------------------------
// Path parameter

/// The key is a path parameter of the matched axum route; see [`path_param`].
#[cfg(feature = "axum")]
#[derive(Debug, Clone)]
pub struct PathParam {
    name: Arc<str>,
}

/// The key is the path parameter `name` of the matched axum route, percent-decoded
/// (e.g. `id` in `/orders/{id}`). A matched route without a parameter of that name
/// is a server mistake: 500 `key-misconfigured`, logged as an error.
///
/// Path parameters exist only after routing: apply the layer with
/// [`Router::route_layer`](axum::Router::route_layer), [`Router::layer`](axum::Router::layer)
/// or [`MethodRouter::layer`](axum::routing::MethodRouter::layer), not around the whole
/// router. Outside a router no key is found (and a warning is logged).
#[cfg(feature = "axum")]
pub fn path_param(name: impl Into<Arc<str>>) -> PathParam {
    PathParam { name: name.into() }
}

#[cfg(feature = "axum")]
impl KeyFromParts for PathParam {
    fn key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
        use axum::extract::rejection::RawPathParamsRejection;
        use axum::extract::{FromRequestParts, RawPathParams};
        use futures_util::FutureExt;

        // axum's extractor reads the parameters routing left in the extensions; its
        // future is ready at once.
        match RawPathParams::from_request_parts(parts, &()).now_or_never() {
            Some(Ok(params)) => {
                let found = params
                    .iter()
                    .find(|(name, _)| *name == &*self.name)
                    .map(|(_, value)| value.to_owned());
                // A matched route without the parameter is the server's mistake (a
                // typo, or the layer on the wrong route), never the client's: 500, not
                // 400. Without a matched route (the router's fallback under
                // `Router::layer`) there is simply no key.
                match (found, parts.extensions.get::<axum::extract::MatchedPath>()) {
                    (None, Some(route)) => {
                        let detail = format!(
                            "the route `{}` has no path parameter `{}` to take the lock key from",
                            route.as_str(),
                            self.name
                        );
                        tracing::error!("lock key misconfigured: {detail}");
                        Err(KeyRejection::misconfigured(detail))
                    }
                    (found, _) => Ok(found),
                }
            }
            Some(Err(RawPathParamsRejection::InvalidUtf8InPathParam(_))) => Err(
                KeyRejection::invalid(format!("the `{}` path parameter is not UTF-8", self.name)),
            ),
            Some(Err(_)) | None => {
                tracing::warn!(
                    param = %self.name,
                    "no path parameters: apply the lock layer inside the axum router (route_layer or layer)"
                );
                Ok(None)
            }
        }
    }

    fn describe(&self) -> String {
        format!("the `{}` path parameter", self.name)
    }
}

// ---------------------------------------------------------------------------------
// JSON body field

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
pub(super) async fn read_limited<B>(body: B, limit: usize) -> Result<Bytes, KeyRejection>
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

// ---------------------------------------------------------------------------------
// Webhook presets

/// Keys of well-known webhook senders: each delivery is processed once at a time, so
/// a retried delivery waits for (or is refused during) the first one.
pub mod webhook {
    use super::{header, json_field, Header, JsonField, KeyFromParts, Or};

    /// GitHub: the `X-GitHub-Delivery` header (a GUID per delivery, kept on redelivery).
    pub fn github() -> Header {
        header("x-github-delivery")
    }

    /// Stripe: the event id, the body field `/id` (e.g. `evt_1Nx…`). The body reaches
    /// the handler unchanged, so `Stripe-Signature` still verifies.
    pub fn stripe() -> JsonField {
        json_field("/id")
    }

    /// Shopify: the `X-Shopify-Event-Id` header, or `X-Shopify-Webhook-Id` when absent
    /// (older API versions).
    pub fn shopify() -> Or<Header, Header> {
        header("x-shopify-event-id").or(header("x-shopify-webhook-id"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Method;

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
