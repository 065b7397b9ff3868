//! Replay's steps on the layer's one path; see the [module documentation](super) for
//! why each step is where it is.

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use http::header::HeaderValue;
use http::request::Parts;
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use tracing::Span;

use super::stored::StoredResponse;
use super::{Replay, IDEMPOTENT_REPLAYED};
use crate::http::body::LeaseBody;
use crate::http::extensions::{InterruptedAttempt, LeaseLost};
use crate::http::key::{KeyRejection, Read};
use crate::http::layer::Settings;
use crate::http::policy::{matched_path_in, OnLost};
use crate::http::problem::{self, acquisition_problem, Problem, ProblemKind};
#[cfg(feature = "postgres")]
use crate::http::replay::handler_tx::{TxSlot, TxState};
use crate::http::section::{finish, finish_with, refuse};
use crate::lock::record;
use crate::node::Record;
use crate::record::Claim;
use crate::LockError;
use crate::{metrics, Lease, LeaseHandle, LostCause, Resource};

/// A replaying request's steps on the layer's one path: [`start`](Self::start) with the
/// keys, [`lookup`](Self::lookup) before the lock, [`claim`](Self::claim) under the
/// lease before the handler, [`record`](Self::record) under the lease after it.
pub(crate) struct ReplayStep {
    policy: Arc<Replay>,
    /// What the record must match.
    fingerprint: Bytes,
    /// The client, for [`Replay::per_client`](super::Replay::per_client).
    client: Option<String>,
    /// The request matched a route (axum's `MatchedPath`): a 404 is the handler's.
    routed: bool,
    /// Where a [`Tx`](crate::axum::Tx) leaves the handler's transaction, with records
    /// in PostgreSQL.
    #[cfg(feature = "postgres")]
    tx: Option<TxSlot>,
}

/// The handler's transaction as the layer finds it after the handler.
#[cfg(feature = "postgres")]
type HandlerTx = TxState;
#[cfg(not(feature = "postgres"))]
type HandlerTx = std::convert::Infallible;

impl ReplayStep {
    /// The client (400 `key-missing` without one, when the records are per client) and
    /// the fingerprint of the request, reading its body (413 over the replay's limit)
    /// unless the key extractor read it already (`read`, into `bytes`).
    pub(crate) async fn start<R: Read<B>, B: Send + 'static>(
        policy: &Arc<Replay>,
        parts: &mut Parts,
        mut body: B,
        bytes: &mut Bytes,
        read: bool,
    ) -> Result<(ReplayStep, B), KeyRejection> {
        let client = match &policy.client {
            None => None,
            Some((find, describe)) => Some(find(parts)?.ok_or_else(|| {
                KeyRejection::missing(format!(
                    "idempotency keys on this route are kept per client, and the request \
                     names none (expected {describe})"
                ))
            })?),
        };
        let limit = policy.max_request_body;
        let too_large = || {
            KeyRejection::with_kind(
                ProblemKind::BodyTooLarge,
                format!(
                    "the body is larger than {limit} bytes, the limit for an idempotent request"
                ),
            )
        };
        if policy.fingerprint.reads_body() {
            if read && bytes.len() > limit {
                return Err(too_large());
            }
            if !read {
                let head = std::mem::replace(parts, Request::new(()).into_parts().0);
                let (request, read) = R::read(Request::from_parts(head, body), limit)
                    .await
                    .map_err(|rejection| match rejection.kind() {
                        ProblemKind::BodyTooLarge => too_large(),
                        _ => rejection,
                    })?;
                let (head, rebuilt) = request.into_parts();
                (*parts, body, *bytes) = (head, rebuilt, read);
            }
        }
        let step = ReplayStep {
            fingerprint: policy.fingerprint.compute(parts, bytes)?,
            policy: policy.clone(),
            client,
            routed: matched_path_in(&parts.extensions).is_some(),
            #[cfg(feature = "postgres")]
            tx: (policy.records.clone()).map(|records| TxSlot {
                records,
                state: Default::default(),
            }),
        };
        Ok((step, body))
    }

    /// The resource of this request's lock and record: with a client, one more part,
    /// the client's SHA-256.
    pub(crate) fn scope(&self, resource: Resource) -> Resource {
        match &self.client {
            None => resource,
            Some(client) => {
                let mut hex = String::new();
                crate::push_hex(&mut hex, &Sha256::digest(client.as_bytes())[..16]);
                resource.join("client").join(hex)
            }
        }
    }

    /// Whether the claim under the lock is the first look at the record, and
    /// [`lookup`](Self::lookup) runs only when the lock is not taken: records claimed in
    /// the handler's transaction ([`PgRecords::handlers_take_tx`](crate::http::replay::PgRecords::handlers_take_tx)).
    pub(crate) fn lookup_under_lock(&self) -> bool {
        #[cfg(feature = "postgres")]
        return (self.policy.records.as_ref()).is_some_and(|records| records.claim_in_tx);
        #[cfg(not(feature = "postgres"))]
        false
    }

    /// Before locking: a completed record every node holds is answered at once,
    /// without locking. A failed lookup is not final: the claim reads the record again.
    pub(crate) async fn lookup<RB: Body>(
        &self,
        settings: &Settings,
        span: &Span,
        resource: &Resource,
    ) -> Option<Response<LeaseBody<RB>>> {
        let failed = |error: &dyn std::fmt::Display| {
            tracing::debug!(%error, "record lookup failed; locking");
        };
        #[cfg(feature = "postgres")]
        if let Some(records) = &self.policy.records {
            let found = records
                .read(resource)
                .await
                .inspect_err(|e| failed(e))
                .ok()?;
            return found.map(|record| self.answer(settings, span, &record, resource));
        }
        // A node lacking it (restarted empty): the claim under the lock finds it on the
        // others, writes it back, and answers it.
        let found = settings.locker.find_record(resource.clone()).await;
        let found = found.inspect_err(|e| failed(e)).ok()??;
        found
            .everywhere
            .then(|| self.answer(settings, span, &found.record, resource))
    }

    /// Under the lease, before the handler: the record claimed. `None`: the handler
    /// runs (told of an interrupted attempt in `extensions`); else the answer, a
    /// recorded response or a refusal, and the lease is to be released.
    pub(crate) async fn claim<RB: Body>(
        &self,
        settings: &Settings,
        span: &Span,
        handle: &LeaseHandle,
        extensions: &mut http::Extensions,
    ) -> Option<Response<LeaseBody<RB>>> {
        let resource = handle.resource();
        tracing::debug!(token = %handle.fencing_token(), "lease acquired; claiming the record");
        let problem = match self.claim_record(handle).await {
            Ok(claim @ (Claim::Claimed | Claim::Reclaimed { .. })) => {
                if let Claim::Reclaimed { interrupted } = claim {
                    tracing::warn!(%interrupted, "an earlier attempt with this key was interrupted: running again, the handler is told");
                    extensions.insert(InterruptedAttempt::new(interrupted));
                }
                self.offer_tx(extensions);
                return None;
            }
            Ok(Claim::Completed(record)) => {
                return Some(self.answer(settings, span, &record, resource))
            }
            Ok(Claim::Unknown { retry_after }) => {
                tracing::warn!(
                    ?retry_after,
                    "an earlier request with this key was interrupted: outcome unknown"
                );
                problem::outcome_unknown(retry_after, resource.clone())
            }
            Err(problem) => problem,
        };
        Some(refuse(settings, span, problem))
    }

    /// The record claimed where the records are kept.
    async fn claim_record(&self, handle: &LeaseHandle) -> Result<Claim, Problem> {
        let policy = &*self.policy;
        #[cfg(feature = "postgres")]
        if let Some(records) = &policy.records {
            let (fingerprint, ttl) = (&self.fingerprint, policy.pending_ttl());
            let (claim, tx) =
                (records.claim(handle, fingerprint, ttl, policy.unknown_for())).await?;
            if let (Some(tx), Some(slot)) = (tx, &self.tx) {
                *crate::lock_unpoisoned(&slot.state) = tx;
            }
            return Ok(claim);
        }
        let claimed = record::claim_owned(
            handle.clone(),
            self.fingerprint.clone(),
            policy.pending_ttl(),
            policy.unknown_for(),
            Some(policy.retention),
        );
        claimed
            .await
            .map_err(|error| acquisition_problem(&error, handle.resource().clone(), None))
    }

    /// With records in PostgreSQL, the slot a [`Tx`](crate::axum::Tx) takes the
    /// handler's transaction from.
    fn offer_tx(&self, extensions: &mut http::Extensions) {
        #[cfg(feature = "postgres")]
        if let Some(slot) = &self.tx {
            extensions.insert(slot.clone());
        }
        let _ = extensions;
    }

    /// The handler's transaction (`None`: records on the nodes), closed to new ones.
    pub(crate) fn handler_tx(&self) -> Option<HandlerTx> {
        #[cfg(feature = "postgres")]
        return (self.tx.as_ref().map(TxSlot::close))
            .filter(|state| !matches!(state, TxState::Free));
        #[cfg(not(feature = "postgres"))]
        None
    }

    /// The response recorded where the records are kept. `Ok(Err(cause))`: sent, not
    /// recorded (`cause`: the lease was lost). `Err`: the handler's transaction was
    /// rolled back, or its commit failed, and this problem answers instead.
    async fn store(
        &self,
        tx: Option<HandlerTx>,
        handle: &LeaseHandle,
        data: Bytes,
    ) -> Result<Result<(), Option<LostCause>>, Problem> {
        let (fingerprint, retention) = (self.fingerprint.clone(), self.policy.retention);
        #[cfg(feature = "postgres")]
        if let Some(records) = &self.policy.records {
            return records
                .record(tx, handle, &fingerprint, &data, retention)
                .await;
        }
        let _ = tx;
        let stored = record::store_owned(handle.clone(), fingerprint, data, retention).await;
        Ok(stored.map_err(|error| {
            tracing::warn!(%error, "response sent but not recorded: the key answers outcome-unknown for a while");
            match error {
                LockError::Lost { cause, .. } => Some(cause),
                _ => None,
            }
        }))
    }

    /// Our pending marker removed and the handler's transaction rolled back: nothing is
    /// recorded, the next request runs again.
    async fn settle(&self, tx: Option<HandlerTx>, handle: &LeaseHandle) {
        #[cfg(feature = "postgres")]
        if let Some(records) = &self.policy.records {
            let _ = records.discard(tx, handle).await;
            return;
        }
        let _ = tx;
        if let Err(error) = record::discard_owned(handle.clone()).await {
            tracing::warn!(%error, "pending record marker not removed: the key answers outcome-unknown for a while");
        }
    }

    /// A response not recorded: our pending marker removed, the handler's transaction
    /// rolled back. `Some`: the refusal sent instead of a response too large to record
    /// whose handler wrote in that transaction.
    async fn not_recorded<RB: Body>(
        &self,
        settings: &Settings,
        span: &Span,
        tx: Option<HandlerTx>,
        too_large: bool,
        handle: &LeaseHandle,
    ) -> Option<Response<LeaseBody<RB>>> {
        // Whether the handler took a transaction (its writes are rolled back with it).
        #[cfg(feature = "postgres")]
        let wrote_in_tx = matches!(tx, Some(TxState::Taken | TxState::Returned(_)));
        #[cfg(not(feature = "postgres"))]
        let wrote_in_tx = tx.is_some();
        self.settle(tx, handle).await;
        let resource = handle.resource().clone();
        (too_large && wrote_in_tx).then(|| refuse(settings, span, problem::rolled_back(resource)))
    }

    /// Under a live lease, after the handler answered: the response read and recorded
    /// before it is sent, or (a status not worth keeping, a response routing produced,
    /// a body known to be too large) the pending marker removed and the answer made as
    /// usual.
    pub(crate) async fn record<RB: Body>(
        self,
        settings: &Settings,
        span: &Span,
        response: Response<RB>,
        lease: Lease,
        handle: LeaseHandle,
    ) -> Response<LeaseBody<RB>> {
        let (policy, routed) = (&*self.policy, self.routed);
        // The handler's writes through it commit only with their record.
        let tx = self.handler_tx();
        let status = response.status();
        let too_large = response.body().size_hint().lower() > policy.max_body as u64;
        // The router answers 405 for a method the route lacks (under `MethodRouter::layer`
        // or `Router::layer`), and 404 from its fallback, where no route matched: neither
        // is the outcome of the request, and replaying them for 24 h would only hide the
        // route. A handler's own 404 on a matched route is kept.
        let by_routing = status == StatusCode::METHOD_NOT_ALLOWED
            || (status == StatusCode::NOT_FOUND && !routed);
        if by_routing || !(policy.store_if)(status) || too_large {
            if by_routing {
                tracing::debug!(%status, "the router's answer, not the handler's: not recorded for replay");
            } else if too_large {
                too_large_warning(policy.max_body);
            } else {
                tracing::debug!(%status, "status not recorded for replay: the next request runs again");
            }
            if let Some(refusal) = self
                .not_recorded(settings, span, tx, too_large, &handle)
                .await
            {
                return refusal;
            }
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
            self.settle(tx, &handle).await;
            drop(lease);
            let problem = problem::response_failed(handle.resource().clone());
            return refuse(settings, span, problem);
        }
        if buffer.len() > policy.max_body {
            too_large_warning(policy.max_body);
            if let Some(refusal) = self.not_recorded(settings, span, tx, true, &handle).await {
                return refusal;
            }
            let (prefix, abort) = (buffer.freeze(), settings.on_lost == OnLost::Abort);
            let body = |lease| LeaseBody::rest(prefix, body, lease, abort);
            let (lease, handle, hold) = (Some(lease), Some(handle), settings.hold_through_body);
            return finish_with(settings, span, parts, lease, handle, hold, body).await;
        }
        let bytes = buffer.freeze();
        let stored =
            StoredResponse::new(parts.status, &parts.headers, &policy.headers, bytes.clone());
        let stored = match self.store(tx, &handle, stored.encode()).await {
            Ok(stored) => stored,
            Err(problem) => {
                drop(lease);
                return refuse(settings, span, problem);
            }
        };
        let outcome = if stored.is_ok() {
            tracing::debug!("response recorded for replay");
            "recorded"
        } else {
            "not-recorded"
        };
        let body = |_| LeaseBody::recorded(bytes, trailers);
        // Nothing is left to do under the lease: release it now, so a waiter gets the
        // record without waiting for the body to be sent.
        let (lease, handle) = (Some(lease), Some(handle));
        let mut response = finish_with(settings, span, parts, lease, handle, false, body).await;
        if let Err(Some(cause)) = &stored {
            // The nodes said so before the watchdog did.
            if response.extensions().get::<LeaseLost>().is_none() {
                response.extensions_mut().insert(LeaseLost(*cause));
            }
        }
        metrics::replay(outcome);
        if response.extensions().get::<LeaseLost>().is_none() {
            span.record("outcome", outcome);
        }
        response
    }

    /// The answer to a request whose key has a completed record: the recorded response
    /// replayed, or 422 when the record answers a different request.
    fn answer<RB: Body>(
        &self,
        settings: &Settings,
        span: &Span,
        record: &Record,
        resource: &Resource,
    ) -> Response<LeaseBody<RB>> {
        if !self.policy.matches(&self.fingerprint, record.fingerprint()) {
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
        let headers = response.headers_mut();
        *headers = stored.headers;
        if let (Some(name), token @ 1..) = (&settings.fencing_header, record.token().get()) {
            headers.insert(name.clone(), HeaderValue::from(token));
        }
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
    }
}

fn too_large_warning(limit: usize) {
    tracing::warn!(
        limit,
        "response body larger than the replay limit: sent, not recorded"
    );
}
