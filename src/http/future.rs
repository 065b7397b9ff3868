//! [`ResponseFuture`]: extract the key, acquire the lease, call the inner service; with
//! replay, also look up, claim and record the outcome.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http::header::HeaderValue;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Body;
use pin_project::pin_project;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Span;

use super::body::LeaseBody;
use super::key::{validate, KeyExtractor};
use super::layer::{matched_path, Contention, MissingKey, OnLost, Settings, Unavailable};
use super::problem::{self, lock_error_problem as problem_of, Problem, ProblemKind, RETRY_SOON};
use super::replay::{ReplayRequest, ReplaySettings, StoredResponse, IDEMPOTENT_REPLAYED};
use super::service::{LeaseLost, RequestKey, Unlocked};
use crate::error::LockError;
use crate::lock::record::{self, Claim, Record};
use crate::lock::{metrics, Lease, LeaseHandle, LostCause, Resource};

type AcquireFuture = Pin<Box<dyn Future<Output = Result<Lease, LockError>> + Send>>;
type LostFuture = Pin<Box<dyn Future<Output = LostCause> + Send>>;
type LookupFuture = Pin<Box<dyn Future<Output = Result<Option<Record>, LockError>> + Send>>;
type ClaimFuture = Pin<Box<dyn Future<Output = Result<Claim, LockError>> + Send>>;
type WriteFuture = Pin<Box<dyn Future<Output = Result<(), LockError>> + Send>>;

/// The response future of [`LockService`](super::LockService).
///
/// A small state machine: extract the key, acquire the lease, run the inner service's
/// future (racing the lease's lost signal under [`OnLost::Abort`]). With
/// [`replay`](super::LockLayer::replay) it also looks the record up before locking,
/// claims it after, and reads the response body (`RB`) and records it before
/// answering. Dropping it at any point drops what it holds, and a dropped lease is
/// released in the background.
#[pin_project]
pub struct ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>>,
    K: KeyExtractor<B>,
{
    #[pin]
    state: State<S, K::Future, B, RB>,
    key: K,
    settings: Arc<Settings>,
    span: Span,
}

#[pin_project(project = StateProj)]
enum State<S, KF, B, RB>
where
    S: Service<Request<B>>,
{
    Extract {
        #[pin]
        future: KF,
        inner: Option<S>,
    },
    /// Replay: a completed record is answered without locking.
    Lookup {
        future: LookupFuture,
        request: Option<Request<B>>,
        inner: Option<S>,
        resource: Resource,
        fingerprint: Bytes,
    },
    Acquire {
        future: AcquireFuture,
        request: Option<Request<B>>,
        inner: Option<S>,
        resource: Resource,
        started: Instant,
        /// Replay: the request's fingerprint.
        replay: Option<Bytes>,
    },
    /// Replay: the lease is ours; is the work too?
    Claim {
        future: ClaimFuture,
        lease: Option<Lease>,
        request: Option<Request<B>>,
        inner: Option<S>,
        resource: Resource,
        fingerprint: Bytes,
    },
    Call {
        #[pin]
        future: S::Future,
        lease: Option<Lease>,
        handle: Option<LeaseHandle>,
        lost: Option<LostFuture>,
        /// Replay: what recording the response needs.
        replay: Option<Pending>,
    },
    /// Replay: reading the response body, under the lease, to record it.
    Buffer {
        parts: Option<http::response::Parts>,
        body: Option<Pin<Box<RB>>>,
        buffer: BytesMut,
        lease: Option<Lease>,
        handle: Option<LeaseHandle>,
        fingerprint: Bytes,
    },
    /// Replay: writing the record, under the lease, before answering.
    Store {
        future: WriteFuture,
        parts: Option<http::response::Parts>,
        bytes: Bytes,
        trailers: Option<HeaderMap>,
        lease: Option<Lease>,
        handle: Option<LeaseHandle>,
    },
    /// Replay: removing our pending marker (nothing to record), then answering.
    Settle {
        future: WriteFuture,
        then: Option<Then<RB>>,
        lease: Option<Lease>,
        handle: Option<LeaseHandle>,
    },
    Done,
}

/// Replay, while the handler runs: what deciding on and writing the record needs.
struct Pending {
    fingerprint: Bytes,
    /// The request matched a route (axum's `MatchedPath`): a 404 is the handler's.
    routed: bool,
}

/// What [`State::Settle`] answers once the marker is gone.
enum Then<RB> {
    /// The handler's response, as it is.
    Respond(Response<RB>),
    /// The start of the body was read (more than can be recorded): it, then the rest.
    Rest(http::response::Parts, Bytes, Pin<Box<RB>>),
    /// The body failed while it was read.
    Failed(Resource),
}

impl<S, K, B, RB> ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>>,
    K: KeyExtractor<B>,
{
    pub(crate) fn new(inner: S, key: K, settings: Arc<Settings>, request: Request<B>) -> Self {
        let span = tracing::debug_span!(
            "redlock",
            resource = tracing::field::Empty,
            outcome = tracing::field::Empty,
            wait_ms = tracing::field::Empty,
            token = tracing::field::Empty,
        );
        let future = span.in_scope(|| key.extract(request));
        ResponseFuture {
            state: State::Extract {
                future,
                inner: Some(inner),
            },
            key,
            settings,
            span,
        }
    }
}

impl<S, K, B, ResBody> Future for ResponseFuture<S, K, B, ResBody>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    K: KeyExtractor<B>,
    ResBody: Body,
{
    type Output = Result<Response<LeaseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.span.enter();
        let settings: &Settings = this.settings;
        let span: &Span = this.span;
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Extract { future, inner } => {
                    let extracted = ready!(future.poll(cx));
                    let inner = take(inner);
                    let (mut request, key) = match extracted {
                        Ok(found) => found,
                        Err(rejection) => {
                            tracing::debug!(%rejection, "request refused: no usable key");
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(refuse(settings, span, rejection.into())));
                        }
                    };
                    let Some(key) = key else {
                        if settings.missing_key == MissingKey::Reject {
                            this.state.set(State::Done);
                            let detail = format!("no lock key: expected {}", this.key.describe());
                            let problem = Problem::new(ProblemKind::KeyMissing, detail);
                            return Poll::Ready(Ok(refuse(settings, span, problem)));
                        }
                        span.record("outcome", "bypassed");
                        tracing::debug!("no lock key: running without a lock");
                        request.extensions_mut().insert(Unlocked::MissingKey);
                        this.state.set(unlocked(inner, request));
                        continue;
                    };
                    if let Err(detail) = validate(&key, settings.max_key_len) {
                        this.state.set(State::Done);
                        let problem = Problem::new(ProblemKind::KeyInvalid, detail);
                        return Poll::Ready(Ok(refuse(settings, span, problem)));
                    }
                    request
                        .extensions_mut()
                        .insert(RequestKey(Arc::from(key.as_str())));
                    let mut resource = settings.scope.resource(&request, &key);
                    let replay = settings
                        .replay
                        .as_ref()
                        .and(request.extensions_mut().remove::<ReplayRequest>());
                    if let Some(replay) = replay {
                        resource = replay.scope(resource);
                        span.record("resource", resource.as_str());
                        let locker = settings.locker.clone();
                        let lookup = resource.clone();
                        State::Lookup {
                            future: Box::pin(async move { locker.read_record(lookup).await }),
                            request: Some(request),
                            inner: Some(inner),
                            resource,
                            fingerprint: replay.fingerprint,
                        }
                    } else {
                        span.record("resource", resource.as_str());
                        State::Acquire {
                            future: acquire(settings, resource.clone()),
                            request: Some(request),
                            inner: Some(inner),
                            resource,
                            started: Instant::now(),
                            replay: None,
                        }
                    }
                }
                StateProj::Lookup {
                    future,
                    request,
                    inner,
                    resource,
                    fingerprint,
                } => {
                    match ready!(future.as_mut().poll(cx)) {
                        Ok(Some(record)) => {
                            let response =
                                answer_record(settings, span, &record, fingerprint, resource);
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(response));
                        }
                        Ok(None) => {}
                        // The claim after locking reads the record again.
                        Err(error) => tracing::debug!(%error, "record lookup failed; locking"),
                    }
                    State::Acquire {
                        future: acquire(settings, resource.clone()),
                        request: request.take(),
                        inner: inner.take(),
                        resource: resource.clone(),
                        started: Instant::now(),
                        replay: Some(std::mem::take(fingerprint)),
                    }
                }
                StateProj::Acquire {
                    future,
                    request,
                    inner,
                    resource,
                    started,
                    replay,
                } => {
                    let acquired = ready!(future.as_mut().poll(cx));
                    let waited = started.elapsed();
                    span.record("wait_ms", waited.as_millis() as u64);
                    let mut request = take(request);
                    let inner = take(inner);
                    match (acquired, replay.take(), settings.replay.as_deref()) {
                        (Ok(lease), Some(fingerprint), Some(policy)) => {
                            let handle = lease.handle();
                            span.record("token", handle.fencing_token().get());
                            tracing::debug!(token = %handle.fencing_token(), ?waited, "lease acquired; claiming the record");
                            State::Claim {
                                future: Box::pin(record::claim_owned(
                                    handle,
                                    fingerprint.clone(),
                                    policy.pending_ttl(),
                                    policy.unknown_for,
                                )),
                                lease: Some(lease),
                                request: Some(request),
                                inner: Some(inner),
                                resource: resource.clone(),
                                fingerprint,
                            }
                        }
                        (Ok(lease), _, _) => call(settings, span, inner, request, lease, None),
                        (
                            Err(error @ (LockError::Held { .. } | LockError::WaitTimeout { .. })),
                            Some(_),
                            Some(_),
                        ) => {
                            let problem = in_progress(&error, resource.clone());
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(refuse(settings, span, problem)));
                        }
                        (
                            Err(
                                error @ (LockError::Unavailable { .. }
                                | LockError::ValidityExpired { .. }),
                            ),
                            _,
                            _,
                        ) if settings.on_unavailable == Unavailable::FailOpen => {
                            span.record("outcome", "fail-open");
                            tracing::warn!(%error, "lock store unavailable: running without a lock (fail open)");
                            request.extensions_mut().insert(Unlocked::StoreUnavailable);
                            unlocked(inner, request)
                        }
                        (Err(error), _, _) => {
                            let problem = problem_of(&error, resource.clone());
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(refuse(settings, span, problem)));
                        }
                    }
                }
                StateProj::Claim {
                    future,
                    lease,
                    request,
                    inner,
                    resource,
                    fingerprint,
                } => {
                    let claimed = ready!(future.as_mut().poll(cx));
                    let lease = take(lease);
                    match claimed {
                        Ok(Claim::Claimed) => {
                            let fingerprint = std::mem::take(fingerprint);
                            call(
                                settings,
                                span,
                                take(inner),
                                take(request),
                                lease,
                                Some(fingerprint),
                            )
                        }
                        Ok(Claim::Completed(record)) => {
                            drop(lease); // released in the background
                            let response =
                                answer_record(settings, span, &record, fingerprint, resource);
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(response));
                        }
                        Ok(Claim::Unknown { retry_after }) => {
                            drop(lease);
                            tracing::warn!(
                                ?retry_after,
                                "an earlier request with this key was interrupted: outcome unknown"
                            );
                            let mut problem = Problem::new(
                                ProblemKind::OutcomeUnknown,
                                "an earlier request with this key was interrupted before its response was recorded; whether it took effect is unknown",
                            )
                            .with_resource(resource.clone());
                            if let Some(delay) = retry_after {
                                problem = problem.with_retry_after(delay);
                            }
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(refuse(settings, span, problem)));
                        }
                        Err(error) => {
                            drop(lease);
                            let problem = problem_of(&error, resource.clone());
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(refuse(settings, span, problem)));
                        }
                    }
                }
                StateProj::Call {
                    future,
                    lease,
                    handle,
                    lost,
                    replay,
                } => {
                    let response = match future.poll(cx) {
                        Poll::Ready(Ok(response)) => response,
                        Poll::Ready(Err(error)) => {
                            // The lease drops with the state: released in the background.
                            this.state.set(State::Done);
                            return Poll::Ready(Err(error));
                        }
                        Poll::Pending => {
                            let Some(lost) = lost else {
                                return Poll::Pending;
                            };
                            let cause = ready!(lost.as_mut().poll(cx));
                            let resource = handle.as_ref().map(|h| h.resource().clone());
                            // Drop the handler future (and the lost lease) before answering.
                            this.state.set(State::Done);
                            span.record("outcome", ProblemKind::LockLost.code());
                            metrics::refusal(ProblemKind::LockLost.code());
                            tracing::warn!(%cause, "lease lost while the handler ran: handler stopped");
                            let mut problem = Problem::new(
                                ProblemKind::LockLost,
                                "the lock was lost while the request was processed; it was stopped",
                            )
                            .with_retry_after(RETRY_SOON);
                            if let Some(resource) = resource {
                                problem = problem.with_resource(resource);
                            }
                            let mut response = render(settings, &problem);
                            response.extensions_mut().insert(LeaseLost(cause));
                            return Poll::Ready(Ok(response));
                        }
                    };
                    let lease = lease.take();
                    let handle = handle.take();
                    match (replay.take(), settings.replay.as_deref(), lease, handle) {
                        (Some(pending), Some(policy), Some(lease), Some(handle))
                            if handle.is_held() =>
                        {
                            record_or_settle(policy, response, lease, handle, pending)
                        }
                        (_, _, lease, handle) => {
                            // Without replay, or lost: an attempt whose outcome is unknown
                            // keeps its pending marker.
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(finish(
                                settings, span, response, lease, handle,
                            )));
                        }
                    }
                }
                StateProj::Buffer {
                    parts,
                    body,
                    buffer,
                    lease,
                    handle,
                    fingerprint,
                } => {
                    let Some(policy) = settings.replay.as_deref() else {
                        unreachable!("buffering without replay settings")
                    };
                    let reading = body.as_mut().expect("Buffer state without a body");
                    let mut trailers = None;
                    let mut failed = false;
                    loop {
                        match ready!(reading.as_mut().poll_frame(cx)) {
                            None => break,
                            Some(Err(_)) => {
                                failed = true;
                                break;
                            }
                            Some(Ok(frame)) => match frame.into_data() {
                                Ok(data) => {
                                    buffer.put(data);
                                    if buffer.len() > policy.max_body {
                                        break;
                                    }
                                    if reading.is_end_stream() {
                                        break;
                                    }
                                }
                                Err(frame) => {
                                    if let Ok(found) = frame.into_trailers() {
                                        trailers = Some(found);
                                        break;
                                    }
                                }
                            },
                        }
                    }
                    let parts = take(parts);
                    let (lease, handle) = (lease.take(), handle.take());
                    let discard = |handle: &Option<LeaseHandle>| -> WriteFuture {
                        match handle.clone() {
                            Some(handle) => Box::pin(record::discard_owned(handle)),
                            None => Box::pin(std::future::ready(Ok(()))),
                        }
                    };
                    if failed {
                        tracing::warn!("the response body failed while it was read for recording");
                        let resource = handle.as_ref().map(|h| h.resource().clone());
                        State::Settle {
                            future: discard(&handle),
                            then: resource.map(Then::Failed),
                            lease,
                            handle,
                        }
                    } else if buffer.len() > policy.max_body {
                        tracing::warn!(
                            limit = policy.max_body,
                            "response body larger than the replay limit: sent, not recorded"
                        );
                        let prefix = std::mem::take(buffer).freeze();
                        State::Settle {
                            future: discard(&handle),
                            then: Some(Then::Rest(parts, prefix, take(body))),
                            lease,
                            handle,
                        }
                    } else {
                        let bytes = std::mem::take(buffer).freeze();
                        let stored = StoredResponse::new(
                            parts.status,
                            &parts.headers,
                            &policy.headers,
                            bytes.clone(),
                        );
                        let future: WriteFuture = match handle.clone() {
                            Some(handle) => Box::pin(record::store_owned(
                                handle,
                                std::mem::take(fingerprint),
                                stored.encode(),
                                policy.retention,
                            )),
                            None => Box::pin(std::future::ready(Ok(()))),
                        };
                        State::Store {
                            future,
                            parts: Some(parts),
                            bytes,
                            trailers,
                            lease,
                            handle,
                        }
                    }
                }
                StateProj::Store {
                    future,
                    parts,
                    bytes,
                    trailers,
                    lease,
                    handle,
                } => {
                    let stored = ready!(future.as_mut().poll(cx));
                    match &stored {
                        Ok(()) => tracing::debug!("response recorded for replay"),
                        Err(error) => {
                            tracing::warn!(%error, "response sent but not recorded: the key answers outcome-unknown for a while");
                        }
                    }
                    let parts = take(parts);
                    let body = LeaseBody::recorded(std::mem::take(bytes), trailers.take());
                    // Nothing is left to do under the lease: release it now, so a waiter
                    // gets the record without waiting for the body to be sent.
                    let mut response = finish_with(
                        settings,
                        span,
                        parts,
                        lease.take(),
                        handle.take(),
                        false,
                        |_| body,
                    );
                    if let Err(LockError::Lost { cause, .. }) = &stored {
                        // The nodes said so before the watchdog did.
                        if response.extensions().get::<LeaseLost>().is_none() {
                            response.extensions_mut().insert(LeaseLost(*cause));
                        }
                    }
                    metrics::replay(if stored.is_ok() {
                        "recorded"
                    } else {
                        "not-recorded"
                    });
                    if response.extensions().get::<LeaseLost>().is_none() {
                        span.record(
                            "outcome",
                            if stored.is_ok() {
                                "recorded"
                            } else {
                                "not-recorded"
                            },
                        );
                    }
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response));
                }
                StateProj::Settle {
                    future,
                    then,
                    lease,
                    handle,
                } => {
                    if let Err(error) = ready!(future.as_mut().poll(cx)) {
                        tracing::warn!(%error, "pending record marker not removed: the key answers outcome-unknown for a while");
                    }
                    let (lease, handle) = (lease.take(), handle.take());
                    let response = match take(then) {
                        Then::Respond(response) => finish(settings, span, response, lease, handle),
                        Then::Rest(parts, prefix, body) => finish_with(
                            settings,
                            span,
                            parts,
                            lease,
                            handle,
                            settings.hold_through_body,
                            |lease| LeaseBody::rest(prefix, body, lease),
                        ),
                        Then::Failed(resource) => {
                            drop(lease);
                            let problem = Problem::new(
                                ProblemKind::ResponseFailed,
                                "the response body failed before it was sent; nothing was recorded",
                            )
                            .with_resource(resource);
                            refuse(settings, span, problem)
                        }
                    };
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            };
            this.state.set(next);
        }
    }
}

fn take<T>(slot: &mut Option<T>) -> T {
    slot.take()
        .expect("ResponseFuture state entered without its values")
}

fn unlocked<S, KF, B, RB>(mut inner: S, request: Request<B>) -> State<S, KF, B, RB>
where
    S: Service<Request<B>>,
{
    State::Call {
        future: inner.call(request),
        lease: None,
        handle: None,
        lost: None,
        replay: None,
    }
}

/// Calls the inner service under `lease`, with the lease's handle in the extensions.
fn call<S, KF, B, RB>(
    settings: &Settings,
    span: &Span,
    mut inner: S,
    mut request: Request<B>,
    lease: Lease,
    replay: Option<Bytes>,
) -> State<S, KF, B, RB>
where
    S: Service<Request<B>>,
{
    let handle = lease.handle();
    span.record("token", handle.fencing_token().get());
    tracing::debug!(token = %handle.fencing_token(), "running the handler under the lease");
    let replay = replay.map(|fingerprint| Pending {
        fingerprint,
        routed: matched_path(&request).is_some(),
    });
    request.extensions_mut().insert(handle.clone());
    let lost = (settings.on_lost == OnLost::Abort).then(|| {
        let handle = handle.clone();
        Box::pin(async move { handle.lost().await }) as LostFuture
    });
    State::Call {
        future: inner.call(request),
        lease: Some(lease),
        handle: Some(handle),
        lost,
        replay,
    }
}

/// Replay, after the handler answered under a live lease: read the body to record it,
/// or (a status not worth keeping, a response routing produced, a body known to be too
/// large) remove the pending marker and answer as usual.
fn record_or_settle<S, KF, B, RB>(
    policy: &ReplaySettings,
    response: Response<RB>,
    lease: Lease,
    handle: LeaseHandle,
    pending: Pending,
) -> State<S, KF, B, RB>
where
    S: Service<Request<B>>,
    RB: Body,
{
    let status = response.status();
    let too_large = response.body().size_hint().lower() > policy.max_body as u64;
    // The router answers 405 for a method the route lacks (under `MethodRouter::layer`
    // or `Router::layer`), and 404 from its fallback, where no route matched: neither
    // is the outcome of the request, and replaying them for 24 h would only hide the
    // route. A handler's own 404 on a matched route is kept.
    let by_routing = status == StatusCode::METHOD_NOT_ALLOWED
        || (status == StatusCode::NOT_FOUND && !pending.routed);
    if by_routing || !(policy.store_if)(status) || too_large {
        if by_routing {
            tracing::debug!(%status, "the router's answer, not the handler's: not recorded for replay");
        } else if too_large {
            tracing::warn!(
                limit = policy.max_body,
                "response body larger than the replay limit: sent, not recorded"
            );
        } else {
            tracing::debug!(%status, "status not recorded for replay: the next request runs again");
        }
        return State::Settle {
            future: Box::pin(record::discard_owned(handle.clone())),
            then: Some(Then::Respond(response)),
            lease: Some(lease),
            handle: Some(handle),
        };
    }
    let (parts, body) = response.into_parts();
    State::Buffer {
        parts: Some(parts),
        body: Some(Box::pin(body)),
        buffer: BytesMut::new(),
        lease: Some(lease),
        handle: Some(handle),
        fingerprint: pending.fingerprint,
    }
}

/// The answer to a request whose key has a completed record: the recorded response
/// replayed, or 422 when the record answers a different request.
fn answer_record<ResBody>(
    settings: &Settings,
    span: &Span,
    record: &Record,
    fingerprint: &[u8],
    resource: &Resource,
) -> Response<LeaseBody<ResBody>> {
    let matches = settings
        .replay
        .as_ref()
        .is_some_and(|policy| policy.matches(fingerprint, record.fingerprint()));
    if !matches {
        metrics::replay("key-reused");
        let problem = Problem::new(
            ProblemKind::IdempotencyKeyReused,
            "this idempotency key was already used for a different request; use a new key for a new request",
        )
        .with_resource(resource.clone());
        return refuse(settings, span, problem);
    }
    let Some(stored) = StoredResponse::decode(record.data().clone()) else {
        tracing::error!(token = %record.token(), "the recorded response cannot be read");
        let problem = Problem::new(
            ProblemKind::OutcomeUnknown,
            "the response recorded for this idempotency key cannot be read",
        )
        .with_resource(resource.clone());
        return refuse(settings, span, problem);
    };
    span.record("outcome", "replayed");
    metrics::replay("replayed");
    tracing::debug!(token = %record.token(), status = %stored.status, "recorded response replayed");
    let mut response = Response::new(LeaseBody::full(stored.body));
    *response.status_mut() = stored.status;
    *response.headers_mut() = stored.headers;
    let headers = response.headers_mut();
    if let (Some(name), token @ 1..) = (&settings.fencing_header, record.token().get()) {
        headers.insert(name.clone(), HeaderValue::from(token));
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// 409 `request-in-progress`: replay's name for contention on the key.
fn in_progress(error: &LockError, resource: Resource) -> Problem {
    let detail = match error {
        LockError::WaitTimeout { waited, .. } => format!(
            "a request with this idempotency key is still being processed after waiting {} ms; retry later to get its response",
            waited.as_millis()
        ),
        _ => "a request with this idempotency key is being processed; retry later to get its response".to_owned(),
    };
    Problem::new(ProblemKind::RequestInProgress, detail)
        .with_retry_after(error.holder_ttl().unwrap_or(RETRY_SOON))
        .with_resource(resource)
}

fn acquire(settings: &Settings, resource: Resource) -> AcquireFuture {
    let locker = settings.locker.clone();
    match settings.contention {
        Contention::Reject => Box::pin(async move { locker.try_acquire(resource).await }),
        Contention::Wait { timeout } => {
            Box::pin(async move { locker.acquire(resource, timeout).await })
        }
    }
}

/// The handler's response, with the fencing token, the lost marker, and the lease
/// handed to the body (or released now).
fn finish<ResBody>(
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
fn finish_with<ResBody>(
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
    if let (Some(name), token @ 1..) = (&settings.fencing_header, handle.fencing_token().get()) {
        parts.headers.insert(name.clone(), HeaderValue::from(token));
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

fn refuse<ResBody>(
    settings: &Settings,
    span: &Span,
    problem: Problem,
) -> Response<LeaseBody<ResBody>> {
    span.record("outcome", problem.kind().code());
    metrics::refusal(problem.kind().code());
    tracing::debug!(%problem, "request refused");
    render(settings, &problem)
}

// The state machine holds the inner service's future, which need not be `Debug`.
impl<S, K, B, RB> std::fmt::Debug for ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>>,
    K: KeyExtractor<B>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
