//! [`LockService`]: the service [`LockLayer`](super::LockLayer) wraps around its inner
//! one.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::body::LeaseBody;
use tracing::Instrument;

use super::future::{begin, ResponseFuture};
use super::key::{KeyExtractor, Read};
use super::layer::Settings;
use super::policy::ScopePrefix;
use crate::Redlock;

/// Runs each request under a Redlock lease; made by [`LockLayer`](super::LockLayer).
///
/// Generic over the request body (the key extractor must support it) and the response
/// body (wrapped in [`LeaseBody`]); the error type is the inner service's. `poll_ready` is the inner service's; the readied service is called once the lease
/// is acquired, so under [`Contention::Wait`](super::Contention::Wait) a capacity the
/// inner service reserved in `poll_ready` stays reserved while the request waits.
#[derive(Clone)]
pub struct LockService<S, K> {
    inner: S,
    key: K,
    settings: Arc<Settings>,
    /// Shared by the clones the router makes for each request.
    prefix: Arc<ScopePrefix>,
}

impl<S, K> LockService<S, K> {
    pub(crate) fn from_parts(inner: S, key: K, settings: Arc<Settings>) -> Self {
        LockService {
            inner,
            key,
            settings,
            prefix: Arc::default(),
        }
    }

    /// `inner` behind a lock with the defaults of
    /// [`LockLayer::new`](super::LockLayer::new); use the layer's builder for other
    /// settings.
    pub fn new(inner: S, locker: Redlock, key: K) -> Self {
        LockService::from_parts(inner, key, Arc::new(Settings::new(locker)))
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
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    K: KeyExtractor,
    K::Body: Read<ReqBody>,
    ReqBody: Send + 'static,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    S::Error: Send + 'static,
{
    type Response = Response<LeaseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, K, ReqBody, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        if self.settings.own_renderer {
            let renderer = super::problem::LayerRenderer(self.settings.renderer.clone());
            request.extensions_mut().insert(renderer);
        }
        // The inner service was driven to readiness: take it, and leave a clone for
        // the next call (the clone may not be ready).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let span = tracing::debug_span!(
            "redlock",
            resource = tracing::field::Empty,
            outcome = tracing::field::Empty,
            wait_ms = tracing::field::Empty,
            token = tracing::field::Empty,
        );
        let (key, settings, prefix) =
            (self.key.clone(), self.settings.clone(), self.prefix.clone());
        let steps = begin(inner, key, settings, prefix, request, span.clone());
        ResponseFuture::new(Box::pin(steps.instrument(span)))
    }
}
