//! The one acquire path of the crate's HTTP front ends: the key a request carries is
//! checked, the lock it names is taken as the [`Contention`] policy says, and a refusal
//! becomes the [`Problem`] the client gets. [`LockLayer`](super::LockLayer) and the
//! axum extractors both go through here, so the same request is refused the same way
//! (and locks the same resource, [`Scope::resource_of`](super::Scope)) through either.

use std::sync::Arc;

use super::extensions::RequestLeases;
use super::key::validate;
use super::policy::Contention;
use super::problem::{
    counted_error_problem, lock_error_problem, set_error_problem, Problem, ProblemKind,
};
use crate::LockError;
use crate::{Lease, LeaseHandle, LockMode, Redlock, Resource, MAX_RESOURCES_PER_LEASE};

/// A key an extractor found, checked: 400 `key-invalid` when it may not be used.
pub(crate) fn check_key(key: String, max_len: usize) -> Result<String, Problem> {
    match validate(&key, max_len) {
        Ok(()) => Ok(key),
        Err(detail) => Err(Problem::new(ProblemKind::KeyInvalid, detail)),
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

/// What a request locks: the resources its keys name, in the extractor's order, and
/// how it shares them.
pub(crate) struct Target {
    pub(crate) resources: Vec<Resource>,
    /// Named by a multi-key extractor: a refusal names the member that was held.
    pub(crate) set: bool,
    pub(crate) mode: LockMode,
}

impl Target {
    /// The one resource of a single-key extractor.
    pub(crate) fn one(resource: Resource, mode: LockMode) -> Self {
        Target {
            resources: vec![resource],
            set: false,
            mode,
        }
    }

    /// The resources of a multi-key extractor, locked together: exclusively, the one
    /// mode a lease over several resources has. 500 `key-misconfigured` for a request
    /// whose route shares its locks ([`LockMode::Shared`], [`LockMode::Counted`]).
    pub(crate) fn set(resources: Vec<Resource>, mode: LockMode) -> Result<Self, Problem> {
        if !mode.is_exclusive() {
            return Err(Problem::new(
                ProblemKind::KeyMisconfigured,
                format!(
                    "this route takes {mode:?} locks, which cover one key each, but its key \
                     extractor names several; use a single-key extractor or exclusive locks"
                ),
            ));
        }
        Ok(Target {
            resources,
            set: true,
            mode,
        })
    }

    /// The problem every front end sends for `error`.
    pub(crate) fn problem(&self, error: &LockError) -> Problem {
        match (&*self.resources, self.set, self.mode) {
            ([resource], false, LockMode::Counted(permits)) => {
                counted_error_problem(error, permits, resource.clone())
            }
            ([resource], false, _) => lock_error_problem(error, resource.clone()),
            _ => set_error_problem(error, self.resources.len()),
        }
    }
}

/// A request's lock on a [`Target`]: what it acquired, and what it reused.
pub(crate) struct Taken {
    /// What this step acquired; `None` when the request held every resource already.
    pub(crate) lease: Option<Lease>,
    /// The acquired lease's handle, else the first reused one.
    pub(crate) handle: LeaseHandle,
    /// The request's leases reused for resources it held already (the `Locked`
    /// extractor hands them to the handler).
    #[cfg(feature = "axum")]
    pub(crate) reused: Vec<LeaseHandle>,
}

/// Whether one lease of the request with `extensions` (granted by `locker`) holds every
/// resource of `resources` already.
pub(crate) fn covered(locker: &Redlock, extensions: &http::Extensions, target: &Target) -> bool {
    extensions.get::<RequestLeases>().is_some_and(|leases| {
        leases
            .covering(locker, &target.resources, target.mode)
            .is_some()
    })
}

/// The leases of the request with `extensions` that already hold some of `resources`
/// (granted by `locker`), and the resources none of them holds. Per-request
/// reentrancy is decided here, for the layer and the extractors alike: a request never
/// waits for itself.
pub(crate) fn held_already(
    locker: &Redlock,
    extensions: &http::Extensions,
    target: &Target,
) -> (Vec<LeaseHandle>, Vec<Resource>) {
    let (resources, mode) = (&target.resources[..], target.mode);
    let Some(leases) = extensions.get::<RequestLeases>() else {
        return (Vec::new(), resources.to_vec());
    };
    if let Some(covering) = leases.covering(locker, resources, mode) {
        return (vec![covering.clone()], Vec::new());
    }
    let reused: Vec<LeaseHandle> = leases.holding(locker, resources, mode).cloned().collect();
    let wanted = resources
        .iter()
        .filter(|r| {
            reused
                .iter()
                .all(|lease| lease.fencing_token_of(r).is_none())
        })
        .cloned()
        .collect();
    (reused, wanted)
}

/// Takes the locks of `target` for the request with `extensions`, as `contention`
/// says: what the request holds already is reused ([`held_already`]), the rest is
/// acquired as one lease (one resource alone, or a set).
pub(crate) async fn take(
    locker: &Redlock,
    contention: Contention,
    extensions: &http::Extensions,
    target: &Target,
) -> Result<Taken, LockError> {
    let (reused, mut wanted) = held_already(locker, extensions, target);
    if wanted.is_empty()
        && let Some(first) = reused.first()
    {
        return Ok(Taken {
            lease: None,
            handle: first.clone(),
            #[cfg(feature = "axum")]
            reused,
        });
    }
    // A set's and a shared lease's futures are boxed: inline, they would set the size
    // of every request's.
    let mode = target.mode;
    let lease = match (contention, wanted.len()) {
        (Contention::Reject, 1) if mode.is_exclusive() => {
            locker.try_acquire(wanted.swap_remove(0)).await
        }
        (Contention::Wait { timeout }, 1) if mode.is_exclusive() => {
            locker.acquire(wanted.swap_remove(0), timeout).await
        }
        (Contention::Reject, 1) => {
            Box::pin(locker.try_acquire_as(wanted.swap_remove(0), mode)).await
        }
        (Contention::Wait { timeout }, 1) => {
            Box::pin(locker.acquire_as(wanted.swap_remove(0), mode, timeout)).await
        }
        (Contention::Reject, _) => Box::pin(locker.try_acquire_all(wanted)).await,
        (Contention::Wait { timeout }, _) => Box::pin(locker.acquire_all(wanted, timeout)).await,
    }?;
    Ok(Taken {
        handle: lease.handle(),
        lease: Some(lease),
        #[cfg(feature = "axum")]
        reused,
    })
}
