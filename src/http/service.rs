//! [`LockService`], and the markers it leaves in requests and responses.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use tower_layer::Layer;
use tower_service::Service;

use super::body::LeaseBody;
use super::future::ResponseFuture;
use super::key::KeyExtractor;
use super::layer::{LockLayer, Settings};
use crate::lock::{LostCause, Redlock};

/// A response extension: the lease was lost while the handler ran, and the handler's
/// response was passed on anyway ([`OnLost::Continue`](super::OnLost::Continue), or a
/// handler that finished just as the loss was noticed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseLost(pub LostCause);

/// A request extension: the key [`LockLayer`] found in this request and locked on, as
/// the extractor read it (for `Idempotency-Key`, without the quotes of the structured
/// form; for a JSON field, a number as its decimal text).
///
/// Handlers should use it rather than read the key again from the request: a second
/// reading can differ from the layer's (a number read as a string, a quoted header),
/// and then the handler acts on another key than the one the lock protects.
///
/// ```
/// use axum::Extension;
/// use tower_redlock::http::RequestKey;
///
/// async fn handler(Extension(key): Extension<RequestKey>) -> String {
///     format!("processing {}", key.as_str())
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestKey(pub Arc<str>);

impl RequestKey {
    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RequestKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A request extension: the handler runs without a lock, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unlocked {
    /// The request has no key and the layer lets such requests through
    /// ([`MissingKey::Bypass`](super::MissingKey::Bypass)).
    MissingKey,
    /// The lock store could not decide and the layer fails open
    /// ([`Unavailable::FailOpen`](super::Unavailable::FailOpen)).
    StoreUnavailable,
}

/// Runs each request under a Redlock lease; made by [`LockLayer`].
///
/// Generic over the request body (the key extractor must support it) and the response
/// body (wrapped in [`LeaseBody`]). Refusals are responses, so the error type is the
/// inner service's: an `Infallible` service stays `Infallible`.
///
/// `poll_ready` is the inner service's; the readied service is called once the lease
/// is acquired, so under [`Contention::Wait`](super::Contention::Wait) a capacity the
/// inner service reserved in `poll_ready` stays reserved while the request waits.
pub struct LockService<S, K> {
    inner: S,
    key: K,
    settings: Arc<Settings>,
}

impl<S, K> LockService<S, K> {
    pub(crate) fn from_parts(inner: S, key: K, settings: Arc<Settings>) -> Self {
        LockService {
            inner,
            key,
            settings,
        }
    }

    /// `inner` behind a lock with the defaults of [`LockLayer::new`]; use the layer's
    /// builder for other settings.
    pub fn new(inner: S, locker: Redlock, key: K) -> Self
    where
        K: Clone,
    {
        LockLayer::new(locker, key).layer(inner)
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes `self`, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, K: Clone> Clone for LockService<S, K> {
    fn clone(&self) -> Self {
        LockService {
            inner: self.inner.clone(),
            key: self.key.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug> fmt::Debug for LockService<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockService")
            .field("inner", &self.inner)
            .field("key", &self.key)
            .field("settings", &self.settings)
            .finish()
    }
}

impl<S, K, ReqBody, ResBody> Service<Request<ReqBody>> for LockService<S, K>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    K: KeyExtractor<ReqBody>,
    ResBody: Body,
{
    type Response = Response<LeaseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, K, ReqBody, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The inner service was driven to readiness: take it, and leave a clone for
        // the next call (the clone may not be ready).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(inner, self.key.clone(), self.settings.clone(), request)
    }
}
