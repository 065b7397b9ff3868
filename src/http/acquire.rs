//! The one acquire path of the crate's HTTP front ends: the key a request carries is
//! checked, the lock it names is taken as the [`Contention`] policy says, and a refusal
//! becomes the [`Problem`] the client gets. [`LockLayer`](super::LockLayer) and the
//! axum extractors both go through here, so the same request is refused the same way
//! (and locks the same resource, [`Scope::resource_of`](super::Scope)) through either.

use super::key::validate;
use super::policy::Contention;
use super::problem::{lock_error_problem, Problem, ProblemKind};
use crate::lock::LockError;
use crate::lock::{Lease, Redlock, Resource};

/// A key an extractor found, checked: `Ok(None)` when the request has none (the
/// caller's policy decides what that means), 400 `key-invalid` when it may not be used.
pub(crate) fn check_key(found: Option<String>, max_len: usize) -> Result<Option<String>, Problem> {
    match found {
        None => Ok(None),
        Some(key) => match validate(&key, max_len) {
            Ok(()) => Ok(Some(key)),
            Err(detail) => Err(Problem::new(ProblemKind::KeyInvalid, detail)),
        },
    }
}

/// 400 `key-missing`, naming what the extractor looks for (its `describe`).
pub(crate) fn missing_key(expected: &str) -> Problem {
    Problem::new(
        ProblemKind::KeyMissing,
        format!("no lock key: expected {expected}"),
    )
}

/// Takes the lock on `resource`: at once, or queueing up to the timeout.
pub(crate) async fn acquire(
    locker: &Redlock,
    contention: Contention,
    resource: Resource,
) -> Result<Lease, LockError> {
    match contention {
        Contention::Reject => locker.try_acquire(resource).await,
        Contention::Wait { timeout } => locker.acquire(resource, timeout).await,
    }
}

/// [`acquire`], a refusal answered with the problem every front end sends for it.
pub(crate) async fn acquire_or_problem(
    locker: &Redlock,
    contention: Contention,
    resource: Resource,
) -> Result<Lease, Problem> {
    acquire(locker, contention, resource.clone())
        .await
        .map_err(|error| lock_error_problem(&error, resource))
}
