//! [`ResponseFuture`]: a request through the layer, top to bottom: key, lock, the
//! critical section.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use http_body::Body;
use tower_service::Service;
use tracing::{Instrument, Span};

use super::acquire::{check_key, covered, missing_key, name_keys, Taken, Target};
use super::body::LeaseBody;
use super::detach::{finish_detached, BoxFuture};
use super::extensions::{RequestKey, RequestKeys, Unlocked};
use super::key::{KeySetExtractor, Keys};
use super::policy::{matched_path_in, MissingKey, OnDisconnect, ScopePrefix};
use super::replay::{self, ReplayRequest, ReplayStep};
use super::run::{call_unlocked, critical, lock, refuse, NotLocked};
use super::settings::Settings;

type Output<RB, E> = Result<Response<LeaseBody<RB>>, E>;

/// The response future of [`LockService`](super::LockService).
///
/// Extracts the key and acquires the lease (with [`replay`](super::LockLayer::replay),
/// a recorded response is answered first); then runs the critical section: the inner
/// service's future under the lease (racing the lease's lost signal under
/// [`OnLost::Abort`](super::OnLost::Abort)), and with replay the claim before it and
/// the record after it.
///
/// Dropped before the lease is held (the client left while the request waited), it
/// leaves nothing behind. Dropped during the critical section, the section goes on in
/// a task of its own to its end, and the lease is released then
/// ([`OnDisconnect::Finish`]), or it is dropped with the lease released in the
/// background ([`OnDisconnect::Cancel`]). A section that panics is over: it is dropped
/// as the panic unwinds (its lease released at once, nothing recorded; with replay its
/// pending marker stays, as after a crash: the outcome is unknown) and the panic goes
/// on to the caller (`CatchPanicLayer` outside turns it into a 500).
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
    Critical {
        section: BoxFuture<O>,
        /// Runs the section on when its response future is dropped
        /// ([`OnDisconnect::Finish`]); made where the output is known to be `'static`.
        detach: Option<fn(BoxFuture<O>)>,
    },
    Done,
}

/// How the steps before the lock end.
enum Step<O> {
    /// The answer: a refusal, a replayed response, a request run without a lock.
    Answer(O),
    /// The lease is held: the critical section, to run whole.
    Critical(BoxFuture<O>, Option<fn(BoxFuture<O>)>),
}

impl<S, K, B, RB> ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>, Response = Response<RB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    K: KeySetExtractor<B>,
    B: Send + 'static,
    RB: Body + Send + 'static,
    RB::Data: Send,
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
        let future = begin(inner, key, settings, prefix, extracted, span.clone()).instrument(span);
        ResponseFuture {
            state: State::Before(Box::pin(future)),
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
                    Step::Critical(section, detach) => {
                        self.state = State::Critical { section, detach }
                    }
                },
                State::Critical { .. } => {
                    // Out of the state while it is polled: a section whose poll panics
                    // is dropped by the unwinding (its lease released at once), never
                    // detached to be polled again. A panic is not a disconnect.
                    let State::Critical {
                        mut section,
                        detach,
                    } = std::mem::replace(&mut self.state, State::Done)
                    else {
                        unreachable!()
                    };
                    if let Poll::Ready(output) = section.as_mut().poll(cx) {
                        return Poll::Ready(output);
                    }
                    self.state = State::Critical { section, detach };
                    return Poll::Pending;
                }
                State::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

impl<S, K, B, RB> Drop for ResponseFuture<S, K, B, RB>
where
    S: Service<Request<B>>,
    RB: Body,
{
    fn drop(&mut self) {
        if let State::Critical {
            section,
            detach: Some(detach),
        } = std::mem::replace(&mut self.state, State::Done)
        {
            detach(section);
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
            State::Critical { .. } => "critical section",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("step", &step)
            .finish()
    }
}

/// The steps before the critical section: the key, the resources it names, the replay
/// lookup, the lock.
async fn begin<S, K, B, RB>(
    inner: S,
    extractor: K,
    settings: Arc<Settings>,
    prefix: Arc<ScopePrefix>,
    extracted: K::Future,
    span: Span,
) -> Step<Output<RB, S::Error>>
where
    S: Service<Request<B>, Response = Response<RB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    K: KeySetExtractor<B>,
    B: Send + 'static,
    RB: Body + Send + 'static,
    RB::Data: Send,
{
    let answer = |response| Step::Answer(Ok(response));
    let (mut request, found) = match extracted.await {
        Ok(found) => found,
        Err(rejection) => {
            tracing::debug!(%rejection, "request refused: no usable key");
            return answer(refuse(&settings, &span, rejection.into()));
        }
    };
    let mut target = match found {
        Some(Keys::One(key)) => match check_key(key, settings.max_key_len) {
            Ok(key) => {
                let resource = settings.scope.resource_cached(
                    &prefix,
                    request.method(),
                    request.uri(),
                    request.extensions(),
                    &key,
                );
                request
                    .extensions_mut()
                    .insert(RequestKey(Arc::from(key.as_str())));
                Target::one(resource, settings.modes.of(request.method()))
            }
            Err(problem) => return answer(refuse(&settings, &span, problem)),
        },
        Some(Keys::Many(keys)) => {
            let named = name_keys(
                keys,
                settings.max_key_len,
                |index| extractor.describe_key(index),
                |key| settings.scope.resource(&request, key),
            );
            let named = match named {
                Ok(named) => named,
                Err(problem) => return answer(refuse(&settings, &span, problem)),
            };
            let resources = named.iter().map(|(_, resource)| resource.clone()).collect();
            match Target::set(resources, settings.modes.of(request.method())) {
                Ok(target) => {
                    request.extensions_mut().insert(RequestKeys::new(named));
                    target
                }
                Err(problem) => return answer(refuse(&settings, &span, problem)),
            }
        }
        None if settings.missing_key == MissingKey::Reject => {
            let problem = missing_key(&extractor.describe_keys());
            return answer(refuse(&settings, &span, problem));
        }
        None => {
            span.record("outcome", "bypassed");
            tracing::debug!("no lock key: running without a lock");
            let call = call_unlocked(&settings, &span, inner, request, Unlocked::MissingKey);
            return Step::Answer(Box::pin(call).await);
        }
    };

    // Replay: a request this layer locks itself (not one an outer layer or extractor
    // holds the lock for already, whose owner replays) looks its record up first.
    let replaying = match request.extensions_mut().remove::<ReplayRequest>() {
        Some(replaying) if !target.set => {
            let held = covered(&settings.locker, request.extensions(), &target);
            settings
                .replay
                .as_ref()
                .filter(|_| !held)
                .map(|policy| (policy, replaying))
        }
        _ => None,
    };
    let mut replay = None;
    if let Some((policy, replaying)) = replaying {
        let resource = replaying.scope(target.resources.swap_remove(0));
        target.resources.push(resource.clone());
        span.record("resource", resource.as_str());
        let fingerprint = replaying.fingerprint;
        let found = replay::lookup(&settings, policy, &span, &resource, &fingerprint);
        if let Some(response) = Box::pin(found).await {
            return answer(response);
        }
        replay = Some(ReplayStep {
            policy: policy.clone(),
            fingerprint,
            routed: matched_path_in(request.extensions()).is_some(),
        });
    } else {
        match &*target.resources {
            [resource] => span.record("resource", resource.as_str()),
            resources => span.record("resource", tracing::field::debug(resources)),
        };
    }

    let taken: Taken = match lock(
        &settings,
        &span,
        request.extensions(),
        &target,
        replay.is_some(),
    )
    .await
    {
        Ok(taken) => taken,
        Err(NotLocked::Refused(problem)) => return answer(refuse(&settings, &span, problem)),
        Err(NotLocked::FailOpen) => {
            let why = Unlocked::StoreUnavailable;
            let call = call_unlocked(&settings, &span, inner, request, why);
            return Step::Answer(Box::pin(call).await);
        }
    };
    let detach = match settings.on_disconnect {
        OnDisconnect::Finish => Some(finish_detached::<Output<RB, S::Error>> as fn(_)),
        OnDisconnect::Cancel => None,
    };
    let section: BoxFuture<_> = match (replay, taken.lease) {
        (Some(step), Some(lease)) => {
            let section = replay::critical(settings, span.clone(), inner, request, lease, step);
            Box::pin(section.instrument(span))
        }
        (_, lease) => {
            let taken = Taken { lease, ..taken };
            Box::pin(critical(settings, span.clone(), inner, request, taken).instrument(span))
        }
    };
    Step::Critical(section, detach)
}
