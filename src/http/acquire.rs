//! The one acquire path of the crate's HTTP front ends: the key a request carries is
//! checked, the lock it names is taken as the [`Contention`] policy says, and a refusal
//! becomes the [`Problem`] the client gets. [`LockLayer`](super::LockLayer) and the
//! axum extractors both go through here, so the same request is refused the same way
//! (and locks the same resource, [`Scope::resource_of`](super::Scope)) through either.

use std::sync::Arc;

use super::key::validate;
use super::policy::Contention;
use super::problem::{lock_error_problem, set_error_problem, Problem, ProblemKind};
use crate::lock::LockError;
use crate::lock::{Lease, Redlock, Resource, MAX_RESOURCES_PER_LEASE};

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

/// The keys of a multi-key request, each checked (400 `key-invalid` naming it by
/// `describe_key`) and named as a resource by `resource_of`, in the extractor's order;
/// a key naming a resource named before is dropped. 400 `key-invalid` for more
/// resources than a lease takes.
pub(crate) fn name_keys(
    keys: Vec<String>,
    max_len: usize,
    describe_key: impl Fn(usize) -> String,
    resource_of: impl Fn(&str) -> Resource,
) -> Result<Vec<(Arc<str>, Resource)>, Problem> {
    let mut named: Vec<(Arc<str>, Resource)> = Vec::with_capacity(keys.len());
    for (index, key) in keys.into_iter().enumerate() {
        if let Err(detail) = validate(&key, max_len) {
            let member = describe_key(index);
            return Err(Problem::new(
                ProblemKind::KeyInvalid,
                format!("{member}: {detail}"),
            ));
        }
        let resource = resource_of(&key);
        if named.iter().any(|(_, seen)| *seen == resource) {
            continue;
        }
        // Checked as the set grows: an oversized list costs no more than the limit.
        if named.len() == MAX_RESOURCES_PER_LEASE {
            return Err(Problem::new(
                ProblemKind::KeyInvalid,
                format!(
                    "the request names more than {MAX_RESOURCES_PER_LEASE} distinct lock keys; \
                     at most {MAX_RESOURCES_PER_LEASE} are locked together"
                ),
            ));
        }
        named.push((Arc::from(key), resource));
    }
    Ok(named)
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

/// Takes the locks on `resources` as one lease: at once, or queueing up to the timeout.
pub(crate) async fn acquire_all(
    locker: &Redlock,
    contention: Contention,
    resources: Vec<Resource>,
) -> Result<Lease, LockError> {
    match contention {
        Contention::Reject => locker.try_acquire_all(resources).await,
        Contention::Wait { timeout } => locker.acquire_all(resources, timeout).await,
    }
}

/// [`acquire_all`], a refusal answered with the problem every front end sends for it
/// (naming the member that is held).
pub(crate) async fn acquire_all_or_problem(
    locker: &Redlock,
    contention: Contention,
    resources: Vec<Resource>,
) -> Result<Lease, Problem> {
    let count = resources.len();
    acquire_all(locker, contention, resources)
        .await
        .map_err(|error| set_error_problem(&error, count))
}
