//! [`LockError`]: why a lock could not be acquired, extended or kept. The HTTP layer
//! turns it into problem responses.

use std::time::Duration;

use crate::{error::NodeFailure, lock::LostCause, Resource};

/// Why a lock could not be acquired, extended or kept.
///
/// The variants separate the cases a caller must treat differently: contention
/// ([`Held`](LockError::Held), [`WaitTimeout`](LockError::WaitTimeout): someone else
/// has the lock, retry later) from an unusable store
/// ([`Unavailable`](LockError::Unavailable): too few nodes answered).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// Another owner holds the resource on enough nodes that no majority can be won.
    #[error("`{resource}` is held by another owner{}", retry_hint(*holder_ttl))]
    Held {
        /// The contended resource.
        resource: Resource,
        /// The holder's remaining time to live as reported by the nodes, when known.
        holder_ttl: Option<Duration>,
    },
    /// A waiting [`acquire`](crate::Redlock::acquire) reached its deadline while the
    /// resource was still held.
    #[error("gave up waiting for `{resource}` after {waited:?}{}", retry_hint(*holder_ttl))]
    WaitTimeout {
        /// The contended resource.
        resource: Resource,
        /// How long the caller waited.
        waited: Duration,
        /// The holder's remaining time to live, when known.
        holder_ttl: Option<Duration>,
    },
    /// Fewer than a majority of the nodes answered: the store cannot decide.
    #[error(
        "no quorum for `{resource}`: {} of {nodes} nodes failed ({}), {answered} answered, {quorum} needed",
        failures.len(),
        joined(failures)
    )]
    Unavailable {
        /// The resource of the attempt.
        resource: Resource,
        /// Number of nodes of the locker.
        nodes: usize,
        /// Nodes that answered (granted or held).
        answered: usize,
        /// Answers needed.
        quorum: usize,
        /// The nodes that did not answer, and why.
        failures: Vec<NodeFailure>,
    },
    /// A majority granted the lock, but so slowly that less than the minimum validity
    /// was left. The keys are released again.
    #[error("`{resource}` was won too slowly: {validity:?} of validity left, at least {min_validity:?} required")]
    ValidityExpired {
        /// The resource of the attempt.
        resource: Resource,
        /// Validity left when the majority was reached (zero when already past).
        validity: Duration,
        /// The configured floor ([`LockOptions::min_validity`](crate::LockOptions::min_validity)).
        min_validity: Duration,
    },
    /// Too many requests of this process already wait for the resource.
    #[error("{limit} waiters already queue for `{resource}` in this process")]
    QueueFull {
        /// The contended resource.
        resource: Resource,
        /// The configured bound ([`LockOptions::max_waiters`](crate::LockOptions::max_waiters)).
        limit: usize,
    },
    /// The locker is draining ([`Redlock::drain`](crate::Redlock::drain)): the process
    /// is shutting down and takes no new lease. Another instance can.
    #[error("not locking `{resource}`: this locker is draining for shutdown")]
    Draining {
        /// The resource asked for.
        resource: Resource,
    },
    /// Shared holders hold the resource in another mode than asked: a counted lease
    /// whose `n` differs from the holders', a reader among permits, or a permit among
    /// readers (see [`LockMode`](crate::LockMode): a resource's holders share one mode).
    /// Refused at once, also by a waiting `acquire`.
    #[error("`{resource}` is held as {held:?}, asked as {asked:?}: every holder of a resource uses one mode and count")]
    ModeMismatch {
        /// The resource asked for.
        resource: Resource,
        /// The mode its holders hold it in.
        held: crate::LockMode,
        /// The mode asked for.
        asked: crate::LockMode,
    },
    /// The lease is lost (expired, taken over, or renewals failed) and cannot be extended.
    #[error("the lease on `{resource}` is lost: {cause}")]
    Lost {
        /// The resource of the lease.
        resource: Resource,
        /// Why it was lost.
        cause: LostCause,
    },
    /// A set of resources (see [`Redlock::try_acquire_all`](crate::Redlock::try_acquire_all))
    /// that is empty or has more than
    /// [`MAX_RESOURCES_PER_LEASE`](crate::MAX_RESOURCES_PER_LEASE) distinct members.
    /// Refused before any node is asked: nothing was locked.
    #[error(
        "a lease takes 1 to {limit} distinct resources, {count} were given (first: `{resource}`)"
    )]
    ResourceCount {
        /// The set's first member in canonical order; the empty resource (`""`) when
        /// the set is empty.
        resource: Resource,
        /// Distinct resources given.
        count: usize,
        /// The most a lease takes.
        limit: usize,
    },
}

impl LockError {
    /// The resource the error is about.
    pub fn resource(&self) -> &Resource {
        match self {
            LockError::Held { resource, .. }
            | LockError::WaitTimeout { resource, .. }
            | LockError::Unavailable { resource, .. }
            | LockError::ValidityExpired { resource, .. }
            | LockError::QueueFull { resource, .. }
            | LockError::Draining { resource }
            | LockError::ModeMismatch { resource, .. }
            | LockError::Lost { resource, .. }
            | LockError::ResourceCount { resource, .. } => resource,
        }
    }

    /// The holder's remaining time to live, for contention errors that know it.
    pub fn holder_ttl(&self) -> Option<Duration> {
        match self {
            LockError::Held { holder_ttl, .. } | LockError::WaitTimeout { holder_ttl, .. } => {
                *holder_ttl
            }
            _ => None,
        }
    }

    /// `true` for contention: the resource is held by someone else.
    pub fn is_contention(&self) -> bool {
        matches!(self, LockError::Held { .. } | LockError::WaitTimeout { .. })
    }
}

fn retry_hint(holder_ttl: Option<Duration>) -> String {
    holder_ttl.map_or_else(String::new, |ttl| {
        format!(" (free in at most {} ms)", ttl.as_millis())
    })
}

fn joined(failures: &[NodeFailure]) -> String {
    let failures: Vec<String> = failures.iter().map(ToString::to_string).collect();
    failures.join("; ")
}
