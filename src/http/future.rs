//! [`ResponseFuture`]: a request through the layer, top to bottom: key, lock, the
//! critical section.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;
use tracing::{Instrument, Span};

use super::acquire::{missing_key, name, take};
use super::body::LeaseBody;
use super::detach::{BoxFuture, FinishingFuture};
use super::extensions::{RequestLeases, Unlocked};
use super::key::{KeyExtractor, Read};
use super::layer::Settings;
use super::policy::{MissingKey, OnDisconnect, ScopePrefix, Unavailable};
use super::problem::{self, Problem};
use super::replay::ReplayStep;
use super::section::{call_unlocked, critical, refuse};
use crate::LockError;

type Output<RB, E> = Result<Response<LeaseBody<RB>>, E>;

/// The response future of [`LockService`](super::LockService).
///
/// Extracts the keys and acquires the lease (with [`replay`](super::LockLayer::replay),
/// a recorded response is answered first); then runs the critical section.
///
/// Dropped before the lease is held, it leaves nothing behind; dropped during the
/// critical section, as [`OnDisconnect`] says. A section that panics is dropped as the
/// panic unwinds (its lease released at once, nothing recorded; with replay its pending
/// marker stays: the outcome is unknown) and the panic goes on to the caller.
pub struct ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>>,
    RB: Body,
{
    state: State<Output<RB, S::Error>>,
    key: PhantomData<fn() -> K>,
}

/// Two boxed steps rather than one: the step a request is in decides what dropping it
/// means, and the second box is only made for a request that holds its lease.
enum State<O> {
    Before(BoxFuture<Step<O>>),
    Critical(FinishingFuture<O>),
    Done,
}

/// How the steps before the lock end.
pub(super) enum Step<O> {
    /// The answer: a refusal, a replayed response, a request run without a lock.
    Answer(O),
    /// The lease is held: the critical section, to run whole.
    Critical(FinishingFuture<O>),
}

impl<S, K, B, RB> ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>>,
    RB: Body,
{
    /// The future of a request whose steps before the lock are `steps` ([`begin`]).
    pub(super) fn new(steps: BoxFuture<Step<Output<RB, S::Error>>>) -> Self {
        ResponseFuture {
            state: State::Before(steps),
            key: PhantomData,
        }
    }
}

impl<S, K, B, RB> Future for ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>>,
    RB: Body,
{
    type Output = Output<RB, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match &mut self.state {
                State::Before(future) => match ready!(future.as_mut().poll(cx)) {
                    Step::Answer(output) => {
                        self.state = State::Done;
                        return Poll::Ready(output);
                    }
                    Step::Critical(section) => self.state = State::Critical(section),
                },
                // Dropped with the state: run on, or dropped, as `OnDisconnect` says.
                State::Critical(section) => return Pin::new(section).poll(cx),
                State::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

impl<S, K, B, RB> fmt::Debug for ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>>,
    RB: Body,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let step = match self.state {
            State::Before(_) => "locking",
            State::Critical(_) => "critical section",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("step", &step)
            .finish()
    }
}

/// The steps before the critical section: the keys, the resources they name, the
/// replay lookup, then the locks of the target as the layer's policies say, reusing
/// what the request holds already.
pub(super) async fn begin<S, K, B, RB>(
    inner: S,
    extractor: K,
    settings: Arc<Settings>,
    prefix: Arc<ScopePrefix>,
    request: Request<B>,
    span: Span,
) -> Step<Output<RB, S::Error>>
where
    S: Service<Request<B>, Response = Response<RB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    K: KeyExtractor,
    K::Body: Read<B>,
    B: Send + 'static,
    RB: Body + Send + 'static,
    RB::Data: Send,
{
    let answer = |response| Step::Answer(Ok(response));
    let refused = |problem| Step::Answer(Ok(refuse(&settings, &span, problem)));
    let (request, mut bytes) = match extractor.body_limit() {
        Some(limit) => match <K::Body as Read<B>>::read(request, limit).await {
            Ok(read) => read,
            Err(rejection) => return refused(rejection.into()),
        },
        None => (request, Bytes::new()),
    };
    let (mut parts, body) = request.into_parts();
    let found = match extractor.keys(&mut parts, &bytes) {
        Ok(found) => found,
        Err(rejection) => {
            tracing::debug!(%rejection, "request refused: no usable key");
            return refused(rejection.into());
        }
    };
    let Some(found) = found else {
        if settings.missing_key == MissingKey::Reject {
            return refused(missing_key(&extractor.describe()));
        }
        span.record("outcome", "bypassed");
        tracing::debug!("no lock key: running without a lock");
        let request = Request::from_parts(parts, body);
        let call = call_unlocked(&settings, &span, inner, request, Unlocked::MissingKey);
        return Step::Answer(Box::pin(call).await);
    };
    let mode = settings.modes.of(&parts.method);
    let resource_of = |key: &str| {
        let (method, uri, extensions) = (&parts.method, &parts.uri, &parts.extensions);
        settings
            .scope
            .resource_cached(&prefix, method, uri, extensions, key)
    };
    let describe = |index| extractor.describe_key(index);
    let (mut target, keys) = match name(found, settings.max_key_len, describe, resource_of, mode) {
        Ok(named) => named,
        Err(problem) => return refused(problem),
    };
    keys.insert(&mut parts.extensions);

    // Replay: the client and the fingerprint (reading the body when the fingerprint
    // covers it and the key did not read it), then the record looked up before locking.
    let mut replay = None;
    let mut body = body;
    if let Some(policy) = settings
        .replay
        .as_ref()
        .filter(|p| p.methods.contains(&parts.method))
    {
        let read = extractor.body_limit().is_some();
        let started = ReplayStep::start::<K::Body, B>(policy, &mut parts, body, &mut bytes, read);
        let step;
        (step, body) = match started.await {
            Ok(started) => started,
            Err(rejection) => return refused(rejection.into()),
        };
        // A request that holds its lock already (an outer layer's, whose owner replays)
        // neither looks up nor records.
        let leases = parts.extensions.get::<RequestLeases>();
        let (locker, resources) = (&settings.locker, &target.resources);
        if leases
            .and_then(|l| l.covering(locker, resources, target.mode))
            .is_none()
        {
            let resource = step.scope(target.resources.swap_remove(0));
            target.resources.push(resource.clone());
            span.record("resource", resource.as_str());
            if !step.lookup_under_lock()
                && let Some(response) = Box::pin(step.lookup(&settings, &span, &resource)).await
            {
                return answer(response);
            }
            replay = Some(step);
        }
    }
    if replay.is_none() {
        match &*target.resources {
            [resource] => span.record("resource", resource.as_str()),
            resources => span.record("resource", tracing::field::debug(resources)),
        };
    }
    let request = Request::from_parts(parts, body);

    // The clock is read only for a span that records the wait.
    let started = (!span.is_disabled()).then(tokio::time::Instant::now);
    let (locker, contention) = (&settings.locker, settings.contention);
    let taken = take(locker, contention, request.extensions(), &target).await;
    if let Some(started) = started {
        span.record("wait_ms", started.elapsed().as_millis() as u64);
    }
    // Not taken: a record looked up under the lock is looked up now, without it.
    if let (Err(_), Some(step)) = (&taken, replay.as_ref().filter(|s| s.lookup_under_lock())) {
        let resource = &target.resources[0];
        if let Some(response) = Box::pin(step.lookup(&settings, &span, resource)).await {
            return answer(response);
        }
    }
    let problem: Problem = match taken {
        Ok(taken) => {
            let finish = settings.on_disconnect == OnDisconnect::Finish;
            let section = critical(settings, span.clone(), inner, request, taken, replay);
            let section = Box::pin(section.instrument(span));
            return Step::Critical(FinishingFuture::new(section, None, finish));
        }
        // Contention on a replayed key: the first request with it is still at work.
        Err(error @ (LockError::Held { .. } | LockError::WaitTimeout { .. })) => {
            let problem = match replay {
                Some(_) => problem::in_progress(&error, target.resources[0].clone()),
                None => target.problem(&error),
            };
            settings.sections.retry_after(problem)
        }
        Err(error @ (LockError::Unavailable { .. } | LockError::ValidityExpired { .. }))
            if settings.on_unavailable == Unavailable::FailOpen =>
        {
            span.record("outcome", "fail-open");
            // The loss of the quorum is logged once by the locker.
            tracing::debug!(%error, "lock store unavailable: running without a lock (fail open)");
            let why = Unlocked::StoreUnavailable;
            let call = call_unlocked(&settings, &span, inner, request, why);
            return Step::Answer(Box::pin(call).await);
        }
        Err(error) => target.problem(&error),
    };
    Step::Answer(Ok(refuse(&settings, &span, problem)))
}
