//! The replaying path of a request, in order: the record looked up before locking
//! (a completed one is answered at once), the lock taken, the record claimed under the
//! lease, the handler run, and its response recorded under the lease before it is
//! sent. See the [module documentation](super) for why each step is where it is.

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use http::header::HeaderValue;
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use tower_service::Service;
use tracing::Span;

use super::super::body::LeaseBody;
use super::super::extensions::{InterruptedAttempt, LeaseLost};
use super::super::policy::OnLost;
use super::super::problem::{self, lock_error_problem};
use super::super::run::{call_locked, finish, finish_with, refuse, Called};
use super::super::settings::Settings;
use super::stored::StoredResponse;
use super::{ReplaySettings, IDEMPOTENT_REPLAYED};
use crate::lock::record;
use crate::node::Record;
use crate::record::Claim;
use crate::LockError;
use crate::{metrics, Lease, LeaseHandle, Resource};

/// What the critical section of a replaying request needs besides the lease.
pub(crate) struct ReplayStep {
    pub(crate) policy: Arc<ReplaySettings>,
    /// What the record must match.
    pub(crate) fingerprint: Bytes,
    /// The request matched a route (axum's `MatchedPath`): a 404 is the handler's.
    pub(crate) routed: bool,
}

/// Before locking: a completed record every node holds is answered at once, without
/// locking. A failed lookup is not final: the claim after locking reads the record again.
pub(crate) async fn lookup<RB: Body>(
    settings: &Settings,
    policy: &ReplaySettings,
    span: &Span,
    resource: &Resource,
    fingerprint: &Bytes,
) -> Option<Response<LeaseBody<RB>>> {
    match settings.locker.find_record(resource.clone()).await {
        Ok(Some(found)) if found.everywhere => Some(answer_record(
            settings,
            policy,
            span,
            &found.record,
            fingerprint,
            resource,
        )),
        // A node lacks it (restarted empty): the claim under the lock finds it on the
        // others, writes it back, and answers it.
        Ok(_) => None,
        Err(error) => {
            tracing::debug!(%error, "record lookup failed; locking");
            None
        }
    }
}

/// Under the lease: the record claimed, the handler run, its response recorded before
/// it is sent.
pub(crate) async fn critical<S, B, RB>(
    settings: Arc<Settings>,
    span: Span,
    inner: S,
    request: Request<B>,
    lease: Lease,
    step: ReplayStep,
) -> Result<Response<LeaseBody<RB>>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
    RB: Body,
{
    let (settings, span) = (&*settings, &span);
    let handle = lease.handle();
    let ReplayStep {
        policy,
        fingerprint,
        routed,
    } = step;
    let policy = &*policy;
    let resource = handle.resource().clone();
    span.record("token", handle.fencing_token().get());
    tracing::debug!(token = %handle.fencing_token(), "lease acquired; claiming the record");
    let claimed = record::claim_owned(
        handle.clone(),
        fingerprint.clone(),
        policy.pending_ttl(),
        policy.unknown_for,
        Some(policy.retention),
    )
    .await;
    let mut request = request;
    match claimed {
        Ok(Claim::Claimed) => {}
        Ok(Claim::Reclaimed { interrupted }) => {
            tracing::warn!(%interrupted, "an earlier attempt with this key was interrupted: running again, the handler is told");
            request
                .extensions_mut()
                .insert(InterruptedAttempt::new(interrupted));
        }
        Ok(Claim::Completed(record)) => {
            lease.release().await;
            return Ok(answer_record(
                settings,
                policy,
                span,
                &record,
                &fingerprint,
                &resource,
            ));
        }
        Ok(Claim::Unknown { retry_after }) => {
            lease.release().await;
            tracing::warn!(
                ?retry_after,
                "an earlier request with this key was interrupted: outcome unknown"
            );
            let problem = problem::outcome_unknown(retry_after, resource);
            return Ok(refuse(settings, span, problem));
        }
        Err(error) => {
            lease.release().await;
            return Ok(refuse(settings, span, lock_error_problem(&error, resource)));
        }
    }
    let response = match call_locked(settings, span, inner, request, &handle).await? {
        Called::Answered(response) => response,
        // The pending marker stays: the outcome is unknown.
        Called::Stopped(response) => return Ok(response),
    };
    if !handle.is_held() {
        // Lost: an attempt whose outcome is unknown keeps its pending marker.
        return Ok(finish(settings, span, response, Some(lease), Some(handle)).await);
    }
    Ok(record_or_settle(
        settings,
        policy,
        span,
        response,
        lease,
        handle,
        fingerprint,
        routed,
    )
    .await)
}

/// After the handler answered under a live lease: read the body and record it, or (a
/// status not worth keeping, a response routing produced, a body known to be too
/// large) remove the pending marker and answer as usual.
#[allow(clippy::too_many_arguments)]
async fn record_or_settle<RB: Body>(
    settings: &Settings,
    policy: &ReplaySettings,
    span: &Span,
    response: Response<RB>,
    lease: Lease,
    handle: LeaseHandle,
    fingerprint: Bytes,
    routed: bool,
) -> Response<LeaseBody<RB>> {
    let status = response.status();
    let too_large = response.body().size_hint().lower() > policy.max_body as u64;
    // The router answers 405 for a method the route lacks (under `MethodRouter::layer`
    // or `Router::layer`), and 404 from its fallback, where no route matched: neither
    // is the outcome of the request, and replaying them for 24 h would only hide the
    // route. A handler's own 404 on a matched route is kept.
    let by_routing =
        status == StatusCode::METHOD_NOT_ALLOWED || (status == StatusCode::NOT_FOUND && !routed);
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
        settle(&handle).await;
        return finish(settings, span, response, Some(lease), Some(handle)).await;
    }
    let (parts, body) = response.into_parts();
    let mut body = Box::pin(body);
    let mut buffer = BytesMut::new();
    let mut trailers = None;
    let mut failed = false;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            failed = true;
            break;
        };
        match frame.into_data() {
            Ok(data) => {
                buffer.put(data);
                if buffer.len() > policy.max_body || body.is_end_stream() {
                    break;
                }
            }
            Err(frame) => {
                if let Ok(found) = frame.into_trailers() {
                    trailers = Some(found);
                    break;
                }
            }
        }
    }
    if failed {
        tracing::warn!("the response body failed while it was read for recording");
        settle(&handle).await;
        drop(lease);
        let problem = problem::response_failed(handle.resource().clone());
        return refuse(settings, span, problem);
    }
    if buffer.len() > policy.max_body {
        tracing::warn!(
            limit = policy.max_body,
            "response body larger than the replay limit: sent, not recorded"
        );
        settle(&handle).await;
        let prefix = buffer.freeze();
        let abort = settings.on_lost == OnLost::Abort;
        return finish_with(
            settings,
            span,
            parts,
            Some(lease),
            Some(handle),
            settings.hold_through_body,
            |lease| LeaseBody::rest(prefix, body, lease, abort),
        )
        .await;
    }
    let bytes = buffer.freeze();
    let stored = StoredResponse::new(parts.status, &parts.headers, &policy.headers, bytes.clone());
    let stored = record::store_owned(
        handle.clone(),
        fingerprint,
        stored.encode(),
        policy.retention,
    )
    .await;
    match &stored {
        Ok(()) => tracing::debug!("response recorded for replay"),
        Err(error) => {
            tracing::warn!(%error, "response sent but not recorded: the key answers outcome-unknown for a while");
        }
    }
    let body = LeaseBody::recorded(bytes, trailers);
    // Nothing is left to do under the lease: release it now, so a waiter gets the
    // record without waiting for the body to be sent.
    let mut response = finish_with(
        settings,
        span,
        parts,
        Some(lease),
        Some(handle),
        false,
        |_| body,
    )
    .await;
    if let Err(LockError::Lost { cause, .. }) = &stored {
        // The nodes said so before the watchdog did.
        if response.extensions().get::<LeaseLost>().is_none() {
            response.extensions_mut().insert(LeaseLost(*cause));
        }
    }
    let outcome = if stored.is_ok() {
        "recorded"
    } else {
        "not-recorded"
    };
    metrics::replay(outcome);
    if response.extensions().get::<LeaseLost>().is_none() {
        span.record("outcome", outcome);
    }
    response
}

/// Removes our pending marker: nothing is recorded, the next request runs again.
async fn settle(handle: &LeaseHandle) {
    if let Err(error) = record::discard_owned(handle.clone()).await {
        tracing::warn!(%error, "pending record marker not removed: the key answers outcome-unknown for a while");
    }
}

/// The answer to a request whose key has a completed record: the recorded response
/// replayed, or 422 when the record answers a different request.
fn answer_record<ResBody: Body>(
    settings: &Settings,
    policy: &ReplaySettings,
    span: &Span,
    record: &Record,
    fingerprint: &[u8],
    resource: &Resource,
) -> Response<LeaseBody<ResBody>> {
    if !policy.matches(fingerprint, record.fingerprint()) {
        metrics::replay("key-reused");
        return refuse(settings, span, problem::key_reused(resource.clone()));
    }
    let Some(stored) = StoredResponse::decode(record.data().clone()) else {
        tracing::error!(token = %record.token(), "the recorded response cannot be read");
        return refuse(settings, span, problem::record_unreadable(resource.clone()));
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
