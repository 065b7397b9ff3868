//! The critical section of a request through the layer: the handler under the lease,
//! and the layer's response made from the handler's.

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;

use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Collected};
use tokio::time::Instant;
use tower_service::Service;
use tracing::Span;

use super::acquire::Taken;
use super::body::LeaseBody;
use super::extensions::{add_request_lease, LeaseLost, Unlocked};
use super::layer::Settings;
use super::policy::OnLost;
use super::problem::{self, Problem, ProblemKind};
use super::replay::ReplayStep;
use super::tokens::set_fencing_header;
use crate::{metrics, Lease, LeaseHandle, LostCause};

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
    RB: Body,
{
    request.extensions_mut().insert(why);
    let response = inner.call(request).await?;
    Ok(finish(settings, span, response, None, None).await)
}

/// The critical section of a request that holds its locks, the one path whether or
/// not the layer replays: with replay the record is claimed under the lease first (a
/// response recorded meanwhile, or an unknown outcome, answers instead), then the
/// handler runs under the lease (its handle in the request extensions), then its
/// response is recorded before it is sent. It owns all it needs, so that it can run to
/// its end after the client left ([`OnDisconnect::Finish`](super::OnDisconnect::Finish)).
pub(crate) async fn critical<S, B, RB>(
    settings: Arc<Settings>,
    span: Span,
    mut inner: S,
    mut request: Request<B>,
    taken: Taken,
    replay: Option<ReplayStep>,
) -> Result<Response<LeaseBody<RB>>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
    RB: Body,
{
    let (settings, span) = (&*settings, &span);
    let Taken { lease, handle, .. } = taken;
    if lease.is_none() {
        tracing::debug!(token = %handle.fencing_token(), "the request holds this lock already: reusing its lease");
    }
    span.record("token", handle.fencing_token().get());
    if let Some(step) = &replay {
        let claimed = step.claim(settings, span, &handle, request.extensions_mut());
        if let Some(answer) = claimed.await {
            if let Some(lease) = lease {
                lease.release().await;
            }
            return Ok(answer);
        }
    }
    tracing::debug!(token = %handle.fencing_token(), "running the handler under the lease");
    request.extensions_mut().insert(handle.clone());
    add_request_lease(request.extensions_mut(), &handle);
    let started = Instant::now();
    let handler = inner.call(request);
    // Under `OnLost::Abort` the handler future is dropped as soon as the lease is lost,
    // before the answer is made.
    let raced = if settings.on_lost == OnLost::Abort {
        let mut handler = pin!(handler);
        let mut lost = pin!(handle.lost());
        // The handler first: a response that is ready wins over a loss noticed at the
        // same time (`finish` then marks it as lost).
        poll_fn(|cx| match handler.as_mut().poll(cx) {
            Poll::Ready(result) => Poll::Ready(Ok(result)),
            Poll::Pending => lost.as_mut().poll(cx).map(Err),
        })
        .await
    } else {
        Ok(handler.await)
    };
    let response = match raced {
        Ok(result) => {
            settings.sections.record(started.elapsed());
            result?
        }
        // The lease drops: lost, released in the background (with replay, the pending
        // marker stays: the outcome is unknown).
        Err(cause) => return Ok(stopped(settings, span, &handle, cause)),
    };
    match (replay, lease) {
        (Some(step), Some(lease)) if handle.is_held() => {
            Ok(step.record(settings, span, response, lease, handle).await)
        }
        (None, lease) if settings.problem_for_rejections => {
            match problem::rejection(response).await {
                Ok(problem) => {
                    metrics::refusal(problem.kind().code(), Some(&settings.name));
                    let (parts, body) = problem::render(&*settings.renderer, &problem).into_parts();
                    let body = |_| LeaseBody::full(body);
                    Ok(finish_with(settings, span, parts, lease, Some(handle), false, body).await)
                }
                Err(response) => Ok(finish(settings, span, response, lease, Some(handle)).await),
            }
        }
        // A lost lease under replay keeps its pending marker: the outcome is unknown;
        // unless the handler wrote in its transaction, which rolls back (dropped): its
        // response must not be sent then.
        (replay, lease) => {
            if replay.is_some_and(|step| step.handler_tx().is_some()) {
                drop(lease);
                let problem = problem::lock_lost(handle.resource().clone());
                return Ok(refuse(settings, span, problem));
            }
            Ok(finish(settings, span, response, lease, Some(handle)).await)
        }
    }
}

/// 503 `lock-lost`: the lease was lost before the response left, under
/// [`OnLost::Abort`]; the handler (or the reading of its body) was stopped.
fn stopped<RB: Body>(
    settings: &Settings,
    span: &Span,
    handle: &LeaseHandle,
    cause: LostCause,
) -> Response<LeaseBody<RB>> {
    span.record("outcome", ProblemKind::LockLost.code());
    metrics::refusal(ProblemKind::LockLost.code(), Some(&settings.name));
    tracing::warn!(%cause, "lease lost while the handler ran: handler stopped");
    let problem = problem::lock_lost(handle.resource().clone());
    let mut response = render(settings, &problem);
    response.extensions_mut().insert(LeaseLost(cause));
    response
}

/// The largest body of known length that [`finish`] reads under the lease before the
/// response is handed on. What axum's `Json`, `String` and `Bytes` answer is in memory
/// already, and costs nothing to read; a larger known length is most likely a file or a
/// proxied stream, whose copy in memory would cost more than the round trip it saves
/// (the order of [`Replay::max_body`](super::replay::Replay::max_body), which buffers
/// the same way).
const READ_AHEAD: u64 = 1 << 20;

/// The handler's response, with the fencing token and the lost marker; the lease goes
/// to the body (released before the body's end is handed on) or is released now.
///
/// A body of known length up to [`READ_AHEAD`] is read to its end under the lease, and
/// the lease released, before the response is handed on: hyper then writes head and
/// body at once. Handing on a held body instead makes hyper write the head alone, and
/// the body once the release is answered: a second write, which on a connection
/// without `TCP_NODELAY` waits for the client's delayed ACK (40 ms on Linux).
pub(crate) async fn finish<RB: Body>(
    settings: &Settings,
    span: &Span,
    response: Response<RB>,
    lease: Option<Lease>,
    handle: Option<LeaseHandle>,
) -> Response<LeaseBody<RB>> {
    let (parts, body) = response.into_parts();
    // A body already complete (empty) is never polled: nothing to hold it through.
    let hold = settings.hold_through_body && !body.is_end_stream();
    let abort = settings.on_lost == OnLost::Abort;
    let known = body
        .size_hint()
        .exact()
        .is_some_and(|len| len <= READ_AHEAD);
    let (lease, handle) = match (lease, handle) {
        (Some(lease), Some(handle)) if hold && known => {
            return match read_whole(body, &handle, abort).await {
                Ok(read) => {
                    let trailers = read.trailers().cloned();
                    let body = LeaseBody::recorded(read.to_bytes(), trailers);
                    let (lease, handle) = (Some(lease), Some(handle));
                    finish_with(settings, span, parts, lease, handle, false, |_| body).await
                }
                Err(Some(cause)) => stopped(settings, span, &handle, cause),
                Err(None) => {
                    tracing::warn!("the response body failed before it was sent");
                    Box::pin(lease.release()).await;
                    let problem = problem::response_failed(handle.resource().clone());
                    refuse(settings, span, problem)
                }
            };
        }
        other => other,
    };
    let body = |lease: Option<Lease>| match lease {
        Some(lease) => LeaseBody::holding(body, lease, abort),
        None => LeaseBody::new(body),
    };
    finish_with(settings, span, parts, lease, handle, hold, body).await
}

/// `body` read to its end; under `abort`, given up as soon as the lease is lost (`Err`
/// with the cause; `Err(None)`: the body failed).
async fn read_whole<RB: Body>(
    body: RB,
    handle: &LeaseHandle,
    abort: bool,
) -> Result<Collected<RB::Data>, Option<LostCause>> {
    let mut read = pin!(body.collect());
    let mut lost = pin!(handle.lost());
    poll_fn(|cx| match read.as_mut().poll(cx) {
        Poll::Ready(read) => Poll::Ready(read.map_err(|_| None)),
        Poll::Pending if abort => lost.as_mut().poll(cx).map(|cause| Err(Some(cause))),
        Poll::Pending => Poll::Pending,
    })
    .await
}

/// [`finish`] with a body made by `body`, which gets the lease when `hold` and the
/// lease is neither lost nor missing; otherwise the lease is released before this
/// returns (a lost one in the background).
pub(crate) async fn finish_with<RB: Body>(
    settings: &Settings,
    span: &Span,
    mut parts: http::response::Parts,
    lease: Option<Lease>,
    handle: Option<LeaseHandle>,
    hold: bool,
    body: impl FnOnce(Option<Lease>) -> LeaseBody<RB>,
) -> Response<LeaseBody<RB>> {
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
            // Released before the response leaves: the client's next request finds
            // the lock free.
            if let Some(lease) = lease {
                // Boxed: off the common path (the body releases), and large.
                Box::pin(lease.release()).await;
            }
            body(None)
        }
    };
    Response::from_parts(parts, body)
}

fn render<RB: Body>(settings: &Settings, problem: &Problem) -> Response<LeaseBody<RB>> {
    problem::render(&*settings.renderer, problem).map(LeaseBody::full)
}

/// A refusal: counted, logged, recorded in the span, rendered.
pub(crate) fn refuse<RB: Body>(
    settings: &Settings,
    span: &Span,
    problem: Problem,
) -> Response<LeaseBody<RB>> {
    span.record("outcome", problem.kind().code());
    metrics::refusal(problem.kind().code(), Some(&settings.name));
    tracing::debug!(%problem, "request refused");
    render(settings, &problem)
}
