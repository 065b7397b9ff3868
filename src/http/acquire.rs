//! The one acquire path of the layer and the axum extractors, so that the same request
//! is checked, locked and refused the same way through either.

use std::sync::Arc;

use super::extensions::{RequestKey, RequestKeys, RequestLeases};
use super::key::{validate, Found, KeySet};
use super::policy::Contention;
use super::problem::{acquisition_problem, counted_error_problem, Problem, ProblemKind};
use crate::LockError;
use crate::{Lease, LeaseHandle, LockMode, Redlock, Resource, MAX_RESOURCES_PER_LEASE};

/// The keys a request carries, as its handler finds them in the request extensions.
pub(crate) enum NamedKeys {
    One(RequestKey),
    Many(RequestKeys),
}

impl NamedKeys {
    pub(crate) fn insert(self, extensions: &mut http::Extensions) {
        match self {
            NamedKeys::One(key) => extensions.insert(key).map(drop),
            NamedKeys::Many(keys) => extensions.insert(keys).map(drop),
        };
    }
}

/// What the keys an extractor found lock, in `mode`, each named a resource by
/// `resource_of`: each checked (400 `key-invalid`, naming one of several by
/// `describe_key`), in the extractor's order; a key naming a resource named before is
/// dropped; 400 `key-invalid` for more resources than a lease takes.
pub(crate) fn name(
    found: impl KeySet,
    max_len: usize,
    describe_key: impl Fn(usize) -> String,
    resource_of: impl Fn(&str) -> Resource,
    mode: LockMode,
) -> Result<(Target, NamedKeys), Problem> {
    let invalid = |detail| Problem::new(ProblemKind::KeyInvalid, detail);
    let keys = match found.found() {
        Found::One(key) => {
            validate(&key, max_len).map_err(invalid)?;
            let target = Target {
                resources: vec![resource_of(&key)],
                set: false,
                mode,
            };
            return Ok((target, NamedKeys::One(RequestKey(Arc::from(key)))));
        }
        Found::Many(keys) => keys,
    };
    let mut named: Vec<(Arc<str>, Resource)> = Vec::with_capacity(keys.len());
    for (index, key) in keys.into_iter().enumerate() {
        if let Err(detail) = validate(&key, max_len) {
            return Err(invalid(format!("{}: {detail}", describe_key(index))));
        }
        let resource = resource_of(&key);
        if named.iter().any(|(_, seen)| *seen == resource) {
            continue;
        }
        // Checked as the set grows: an oversized list costs no more than the limit.
        if named.len() == MAX_RESOURCES_PER_LEASE {
            return Err(invalid(format!(
                "the request names more than {MAX_RESOURCES_PER_LEASE} distinct lock keys; \
                 at most {MAX_RESOURCES_PER_LEASE} are locked together"
            )));
        }
        named.push((Arc::from(key), resource));
    }
    // A lease over several resources is exclusive.
    if !mode.is_exclusive() {
        return Err(Problem::new(
            ProblemKind::KeyMisconfigured,
            format!(
                "this route takes {mode:?} locks, which cover one key each, but its key \
                 extractor names several; use a single-key extractor or exclusive locks"
            ),
        ));
    }
    let resources = named.iter().map(|(_, resource)| resource.clone()).collect();
    let target = Target {
        resources,
        set: true,
        mode,
    };
    Ok((target, NamedKeys::Many(RequestKeys::new(named))))
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
    /// The problem every front end sends for `error`.
    pub(crate) fn problem(&self, error: &LockError) -> Problem {
        match (&*self.resources, self.set, self.mode) {
            ([resource], false, LockMode::Counted(permits)) => {
                counted_error_problem(error, permits, resource.clone())
            }
            ([resource], false, _) => acquisition_problem(error, resource.clone(), None),
            _ => acquisition_problem(error, error.resource().clone(), Some(self.resources.len())),
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

/// Takes the locks of `target` for the request with `extensions`, as `contention`
/// says: what a lease of the request (granted by `locker`) holds already is reused, so
/// that a request never waits for itself; the rest is acquired as one lease (one
/// resource alone, or a set).
pub(crate) async fn take(
    locker: &Redlock,
    contention: Contention,
    extensions: &http::Extensions,
    target: &Target,
) -> Result<Taken, LockError> {
    let (resources, mode) = (&target.resources[..], target.mode);
    let leases = extensions.get::<RequestLeases>();
    let (reused, mut wanted) = match leases.map(|l| (l, l.covering(locker, resources, mode))) {
        None => (Vec::new(), resources.to_vec()),
        Some((_, Some(covering))) => (vec![covering.clone()], Vec::new()),
        Some((leases, None)) => {
            let reused: Vec<LeaseHandle> =
                leases.holding(locker, resources, mode).cloned().collect();
            let free = |r: &&Resource| reused.iter().all(|l| l.fencing_token_of(r).is_none());
            let wanted = resources.iter().filter(free).cloned().collect();
            (reused, wanted)
        }
    };
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
