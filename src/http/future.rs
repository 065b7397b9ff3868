//! [`ResponseFuture`]: extract the key, acquire the lease, call the inner service.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use tower_service::Service;
use tracing::{Instrument, Span};

use super::acquire::{check_key, missing_key};
use super::body::LeaseBody;
use super::extensions::{RequestKey, RequestLeases, Unlocked};
use super::key::{KeySetExtractor, Keys};
use super::many;
use super::policy::{MissingKey, ScopePrefix};
use super::replay::{self, ReplayRequest};
use super::run::{
    call_locked, call_reentrant, call_unlocked, finish, lock, refuse, Called, NotLocked,
};
use super::settings::Settings;

type Output<RB, E> = Result<Response<LeaseBody<RB>>, E>;

/// The response future of [`LockService`](super::LockService).
///
/// Extracts the key, acquires the lease, and runs the inner service's future under it
/// (racing the lease's lost signal under [`OnLost::Abort`](super::OnLost::Abort));
/// with [`replay`](super::LockLayer::replay) it also looks the record up before
/// locking, claims it after, and records the response before answering. Dropping it at
/// any point drops what it holds, and a dropped lease is released in the background.
pub struct ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>>,
{
    // One allocation per request: the steps read top to bottom in `respond` rather
    // than as the states of a hand-written machine.
    future: Pin<Box<dyn Future<Output = Output<RB, S::Error>> + Send>>,
    key: PhantomData<fn() -> K>,
}

impl<S, K, B, RB> ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>, Response = Response<RB>> + Send + 'static,
    S::Future: Send,
    K: KeySetExtractor<B>,
    B: Send + 'static,
    RB: Body + Send + 'static,
{
    pub(crate) fn new(
        inner: S,
        key: K,
        settings: Arc<Settings>,
        prefix: Arc<ScopePrefix>,
        request: Request<B>,
    ) -> Self {
        let span = tracing::debug_span!(
            "redlock",
            resource = tracing::field::Empty,
            outcome = tracing::field::Empty,
            wait_ms = tracing::field::Empty,
            token = tracing::field::Empty,
        );
        // The extractor starts at once, as the service is called.
        let extracted = span.in_scope(|| key.extract_keys(request));
        let future =
            respond(inner, key, settings, prefix, extracted, span.clone()).instrument(span);
        ResponseFuture {
            future: Box::pin(future),
            key: PhantomData,
        }
    }
}

impl<S, K, B, RB> Future for ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>>,
{
    type Output = Output<RB, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.future.as_mut().poll(cx)
    }
}

impl<S, K, B, RB> fmt::Debug for ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// A request through the layer: key → lock → handler, or replay's path.
async fn respond<S, K, B, RB>(
    inner: S,
    extractor: K,
    settings: Arc<Settings>,
    prefix: Arc<ScopePrefix>,
    extracted: K::Future,
    span: Span,
) -> Output<RB, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
    K: KeySetExtractor<B>,
    RB: Body,
{
    let (settings, span) = (&*settings, &span);
    let (mut request, found) = match extracted.await {
        Ok(found) => found,
        Err(rejection) => {
            tracing::debug!(%rejection, "request refused: no usable key");
            return Ok(refuse(settings, span, rejection.into()));
        }
    };
    // The paths off the common one (one key, locked now) are boxed: inline, the
    // largest of their futures would set the size of the future every request
    // allocates (4.1 kB with them inline, 3.1 kB without; most of the rest is the
    // locker's acquire future).
    let found = match found {
        Some(Keys::Many(keys)) => {
            return Box::pin(many::respond(
                settings, span, &extractor, inner, request, keys,
            ))
            .await
        }
        Some(Keys::One(key)) => Some(key),
        None => None,
    };
    let key = match check_key(found, settings.max_key_len) {
        Ok(Some(key)) => key,
        Ok(None) if settings.missing_key == MissingKey::Reject => {
            let problem = missing_key(&extractor.describe_keys());
            return Ok(refuse(settings, span, problem));
        }
        Ok(None) => {
            span.record("outcome", "bypassed");
            tracing::debug!("no lock key: running without a lock");
            return Box::pin(call_unlocked(
                settings,
                span,
                inner,
                request,
                Unlocked::MissingKey,
            ))
            .await;
        }
        Err(problem) => return Ok(refuse(settings, span, problem)),
    };
    request
        .extensions_mut()
        .insert(RequestKey(Arc::from(key.as_str())));
    let resource = settings.scope.resource_cached(
        &prefix,
        request.method(),
        request.uri(),
        request.extensions(),
        &key,
    );
    let replaying = request.extensions_mut().remove::<ReplayRequest>();
    if let (Some(policy), Some(replaying)) = (settings.replay.as_deref(), replaying) {
        let resource = replaying.scope(resource);
        span.record("resource", resource.as_str());
        let fingerprint = replaying.fingerprint;
        return Box::pin(replay::respond(
            settings,
            policy,
            span,
            inner,
            request,
            resource,
            fingerprint,
        ))
        .await;
    }
    span.record("resource", resource.as_str());
    if let Some(held) = request
        .extensions()
        .get::<RequestLeases>()
        .and_then(|leases| leases.covering(&settings.locker, std::slice::from_ref(&resource)))
        .cloned()
    {
        return Box::pin(call_reentrant(settings, span, inner, request, held)).await;
    }
    let lease = match lock(settings, span, &resource, false).await {
        Ok(lease) => lease,
        Err(NotLocked::Refused(problem)) => return Ok(refuse(settings, span, problem)),
        Err(NotLocked::FailOpen) => {
            return Box::pin(call_unlocked(
                settings,
                span,
                inner,
                request,
                Unlocked::StoreUnavailable,
            ))
            .await
        }
    };
    let handle = lease.handle();
    match call_locked(settings, span, inner, request, &handle).await? {
        Called::Answered(response) => {
            Ok(finish(settings, span, response, Some(lease), Some(handle)))
        }
        Called::Stopped(response) => Ok(response), // the lease drops: released in the background
    }
}
