//! The steps of a request through the layer that the plain and the replaying paths
//! share: taking the lock under the layer's policies, calling the inner service under
//! the lease, and making the layer's response from the handler's (or from a refusal).

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::task::Poll;

use http::{Request, Response};
use tokio::time::Instant;
use tower_service::Service;
use tracing::Span;

use super::acquire::acquire;
use super::body::LeaseBody;
use super::extensions::{add_request_lease, LeaseLost, Unlocked};
use super::policy::{OnLost, Unavailable};
use super::problem::{self, lock_error_problem, Problem, ProblemKind};
use super::settings::Settings;
use super::tokens::set_fencing_header;
use crate::lock::LockError;
use crate::lock::{metrics, Lease, LeaseHandle, LostCause, Resource};

/// Why [`lock`] took no lease.
pub(crate) enum NotLocked {
    /// Answer with this problem.
    Refused(Problem),
    /// The store cannot decide and the layer fails open: run without a lock.
    FailOpen,
}

/// Takes the lock on `resource` as the layer's policies say. `replaying`: contention
/// on the key means the first request with it is still at work, 409
/// `request-in-progress`.
pub(crate) async fn lock(
    settings: &Settings,
    span: &Span,
    resource: &Resource,
    replaying: bool,
) -> Result<Lease, NotLocked> {
    // The clock is read only for a span that records the wait.
    let started = (!span.is_disabled()).then(Instant::now);
    let acquired = acquire(&settings.locker, settings.contention, resource.clone()).await;
    if let Some(started) = started {
        span.record("wait_ms", started.elapsed().as_millis() as u64);
    }
    match acquired {
        Ok(lease) => Ok(lease),
        Err(error @ (LockError::Held { .. } | LockError::WaitTimeout { .. })) if replaying => Err(
            NotLocked::Refused(problem::in_progress(&error, resource.clone())),
        ),
        Err(error @ (LockError::Unavailable { .. } | LockError::ValidityExpired { .. }))
            if settings.on_unavailable == Unavailable::FailOpen =>
        {
            span.record("outcome", "fail-open");
            tracing::warn!(%error, "lock store unavailable: running without a lock (fail open)");
            Err(NotLocked::FailOpen)
        }
        Err(error) => Err(NotLocked::Refused(lock_error_problem(
            &error,
            resource.clone(),
        ))),
    }
}

/// Runs the handler without a lock, marked with why.
pub(crate) async fn call_unlocked<S, B, RB>(
    settings: &Settings,
    span: &Span,
    mut inner: S,
    mut request: Request<B>,
    why: Unlocked,
) -> Result<Response<LeaseBody<RB>>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
{
    request.extensions_mut().insert(why);
    let response = inner.call(request).await?;
    Ok(finish(settings, span, response, None, None))
}

/// What [`call_locked`] ended with.
pub(crate) enum Called<RB> {
    /// The handler's response.
    Answered(Response<RB>),
    /// The lease was lost and the handler stopped ([`OnLost::Abort`]): 503 `lock-lost`.
    Stopped(Response<LeaseBody<RB>>),
}

/// Calls the inner service under a lease this request already holds (an outer layer's
/// on the same resources): no acquisition, and the lease stays its owner's to release.
pub(crate) async fn call_reentrant<S, B, RB>(
    settings: &Settings,
    span: &Span,
    inner: S,
    request: Request<B>,
    held: LeaseHandle,
) -> Result<Response<LeaseBody<RB>>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
{
    span.record("wait_ms", 0);
    tracing::debug!(token = %held.fencing_token(), "the request holds this lock already: reusing its lease");
    match call_locked(settings, span, inner, request, &held).await? {
        Called::Answered(response) => Ok(finish(settings, span, response, None, Some(held))),
        Called::Stopped(response) => Ok(response),
    }
}

/// Calls the inner service with the lease's handle in the request extensions; under
/// [`OnLost::Abort`] the handler future is dropped as soon as the lease is lost.
pub(crate) async fn call_locked<S, B, RB>(
    settings: &Settings,
    span: &Span,
    mut inner: S,
    mut request: Request<B>,
    handle: &LeaseHandle,
) -> Result<Called<RB>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
{
    span.record("token", handle.fencing_token().get());
    tracing::debug!(token = %handle.fencing_token(), "running the handler under the lease");
    request.extensions_mut().insert(handle.clone());
    add_request_lease(request.extensions_mut(), handle);
    let handler = inner.call(request);
    if settings.on_lost != OnLost::Abort {
        return handler.await.map(Called::Answered);
    }
    let cause = {
        let mut handler = pin!(handler);
        let mut lost = pin!(handle.lost());
        // The handler first: a response that is ready wins over a loss noticed at the
        // same time (`finish` then marks it as lost).
        let raced = poll_fn(|cx| match handler.as_mut().poll(cx) {
            Poll::Ready(result) => Poll::Ready(Ok(result)),
            Poll::Pending => lost.as_mut().poll(cx).map(Err),
        })
        .await;
        match raced {
            Ok(result) => return result.map(Called::Answered),
            Err(cause) => cause,
        }
        // The handler future is dropped here, before the answer is made.
    };
    span.record("outcome", ProblemKind::LockLost.code());
    metrics::refusal(ProblemKind::LockLost.code());
    tracing::warn!(%cause, "lease lost while the handler ran: handler stopped");
    let problem = problem::lock_lost(handle.resource().clone());
    let mut response = render(settings, &problem);
    response.extensions_mut().insert(LeaseLost(cause));
    Ok(Called::Stopped(response))
}

/// The handler's response, with the fencing token, the lost marker, and the lease
/// handed to the body (or released now).
pub(crate) fn finish<ResBody>(
    settings: &Settings,
    span: &Span,
    response: Response<ResBody>,
    lease: Option<Lease>,
    handle: Option<LeaseHandle>,
) -> Response<LeaseBody<ResBody>> {
    let (parts, body) = response.into_parts();
    finish_with(
        settings,
        span,
        parts,
        lease,
        handle,
        settings.hold_through_body,
        |lease| match lease {
            Some(lease) => LeaseBody::holding(body, lease),
            None => LeaseBody::new(body),
        },
    )
}

/// [`finish`] with a body made by `body`, which gets the lease when `hold` and the
/// lease is neither lost nor missing.
pub(crate) fn finish_with<ResBody>(
    settings: &Settings,
    span: &Span,
    mut parts: http::response::Parts,
    lease: Option<Lease>,
    handle: Option<LeaseHandle>,
    hold: bool,
    body: impl FnOnce(Option<Lease>) -> LeaseBody<ResBody>,
) -> Response<LeaseBody<ResBody>> {
    let Some(handle) = handle else {
        drop(lease);
        return Response::from_parts(parts, body(None));
    };
    // Token 0: the locker runs with `LockOptions::fencing(false)`, there is no token.
    if let Some(name) = &settings.fencing_header {
        set_fencing_header(&mut parts.headers, name, &handle);
    }
    // Lost, or past its validity without the watchdog having said so yet.
    let lost = handle
        .lost_cause()
        .or_else(|| (!handle.is_held()).then_some(LostCause::Expired));
    let body = match (lost, lease) {
        (Some(cause), _) => {
            span.record("outcome", "lost");
            tracing::warn!(%cause, "lease lost while the handler ran: response passed on");
            parts.extensions.insert(LeaseLost(cause));
            body(None)
        }
        (None, Some(lease)) if hold => {
            span.record("outcome", "acquired");
            body(Some(lease))
        }
        (None, lease) => {
            span.record("outcome", "acquired");
            drop(lease); // released in the background
            body(None)
        }
    };
    Response::from_parts(parts, body)
}

fn render<ResBody>(settings: &Settings, problem: &Problem) -> Response<LeaseBody<ResBody>> {
    problem::render(&*settings.renderer, problem).map(LeaseBody::full)
}

/// A refusal: counted, logged, recorded in the span, rendered.
pub(crate) fn refuse<ResBody>(
    settings: &Settings,
    span: &Span,
    problem: Problem,
) -> Response<LeaseBody<ResBody>> {
    span.record("outcome", problem.kind().code());
    metrics::refusal(problem.kind().code());
    tracing::debug!(%problem, "request refused");
    render(settings, &problem)
}
