//! A request with several keys ([`Keys::Many`](super::Keys::Many)) through the layer:
//! every key checked and named as a resource, the set locked as one lease, the handler
//! called under it. A request with one key never comes here (`future.rs`).

use http::{Request, Response};
use http_body::Body;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Span;

use super::acquire::{acquire_all, name_keys};
use super::body::LeaseBody;
use super::extensions::{RequestKeys, RequestLeases, Unlocked};
use super::key::KeySetExtractor;
use super::policy::Unavailable;
use super::problem::set_error_problem;
use super::run::{call_locked, call_reentrant, call_unlocked, finish, refuse, Called, NotLocked};
use super::settings::Settings;
use crate::lock::{Lease, LockError, Resource};

type Output<RB, E> = Result<Response<LeaseBody<RB>>, E>;

/// The layer's answer to a request with the keys `keys`.
pub(crate) async fn respond<S, K, B, RB>(
    settings: &Settings,
    span: &Span,
    extractor: &K,
    inner: S,
    mut request: Request<B>,
    keys: Vec<String>,
) -> Output<RB, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
    K: KeySetExtractor<B>,
    RB: Body,
{
    let named = name_keys(
        keys,
        settings.max_key_len,
        |index| extractor.describe_key(index),
        |key| settings.scope.resource(&request, key),
    );
    let named = match named {
        Ok(named) => named,
        Err(problem) => return Ok(refuse(settings, span, problem)),
    };
    let resources: Vec<Resource> = named.iter().map(|(_, resource)| resource.clone()).collect();
    span.record("resource", tracing::field::debug(&resources));
    request.extensions_mut().insert(RequestKeys::new(named));

    // Per-request reentrancy: a lease this request holds already is reused, and only
    // what no lease of the request holds is acquired (never waiting for itself).
    let mut wanted = resources;
    if let Some(leases) = request.extensions().get::<RequestLeases>() {
        if let Some(held) = leases.covering(&settings.locker, &wanted).cloned() {
            return call_reentrant(settings, span, inner, request, held).await;
        }
        let held: Vec<_> = leases.holding(&settings.locker, &wanted).cloned().collect();
        wanted.retain(|resource| {
            held.iter()
                .all(|lease| lease.fencing_token_of(resource).is_none())
        });
        if let (true, Some(first)) = (wanted.is_empty(), held.first()) {
            // Held by several leases of the request together: nothing to acquire.
            return call_reentrant(settings, span, inner, request, first.clone()).await;
        }
    }

    let lease = match lock_set(settings, span, wanted).await {
        Ok(lease) => lease,
        Err(NotLocked::Refused(problem)) => return Ok(refuse(settings, span, problem)),
        Err(NotLocked::FailOpen) => {
            return call_unlocked(settings, span, inner, request, Unlocked::StoreUnavailable).await
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

/// Takes the locks on `resources`, as one lease, as the layer's policies say.
async fn lock_set(
    settings: &Settings,
    span: &Span,
    resources: Vec<Resource>,
) -> Result<Lease, NotLocked> {
    let count = resources.len();
    let started = Instant::now();
    let acquired = acquire_all(&settings.locker, settings.contention, resources).await;
    span.record("wait_ms", started.elapsed().as_millis() as u64);
    match acquired {
        Ok(lease) => Ok(lease),
        Err(error @ (LockError::Unavailable { .. } | LockError::ValidityExpired { .. }))
            if settings.on_unavailable == Unavailable::FailOpen =>
        {
            span.record("outcome", "fail-open");
            tracing::warn!(%error, "lock store unavailable: running without a lock (fail open)");
            Err(NotLocked::FailOpen)
        }
        Err(error) => Err(NotLocked::Refused(set_error_problem(&error, count))),
    }
}
