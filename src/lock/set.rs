//! One lease over a set of resources ([`Redlock::try_acquire_all`],
//! [`Redlock::acquire_all`]): every member or none, one owner value, validity and
//! watchdog for the set, one fencing token per member; extended, released and lost as a
//! whole. What it guarantees and costs per node kind: the guide's "Many resources in
//! one lease" ([`guide::keys`](crate::guide::keys)).
//!
//! Overlapping sets never deadlock: a node grants all of a set or nothing of it, so
//! nobody holds part of a set at the nodes while waiting for the rest (two sets that
//! split the votes retry as a single resource does); and inside a process a set takes
//! its members' local places in canonical order (sorted, deduplicated), so no two
//! callers wait for each other in a circle.

use tokio::time::Instant;

use crate::lock::{lease::LeaseHandle, metrics, target::Target, Lease, LockError, Redlock};
use crate::{FencingToken, Resource};

/// The most distinct resources one lease takes (see [`Redlock::try_acquire_all`]).
///
/// Each member costs a key check and a counter on every node within one atomic call;
/// the bound keeps that call short, so it never holds a node up for the other clients.
pub const MAX_RESOURCES_PER_LEASE: usize = 16;

/// Sorts, deduplicates and checks the size of a set of resources.
fn canonical<R: Into<Resource>>(
    resources: impl IntoIterator<Item = R>,
) -> Result<Vec<Resource>, LockError> {
    let mut set: Vec<Resource> = resources.into_iter().map(Into::into).collect();
    set.sort_unstable();
    set.dedup();
    if set.is_empty() || set.len() > MAX_RESOURCES_PER_LEASE {
        return Err(LockError::ResourceCount {
            resource: set.first().cloned().unwrap_or_else(|| Resource::new("")),
            count: set.len(),
            limit: MAX_RESOURCES_PER_LEASE,
        });
    }
    Ok(set)
}

impl Redlock {
    fn set_of(&self, resources: Vec<Resource>) -> Target {
        Target::set(&self.shared.options.key_prefix, resources)
    }

    /// One attempt at every resource of a set, no waiting: a lease over all of them, or
    /// [`LockError::Held`] naming the first member (in canonical order) found held, with
    /// the longest remaining ttl the nodes reported for the set.
    ///
    /// The set is sorted and its duplicates removed (see
    /// [`LeaseHandle::resources`]); it must have 1 to [`MAX_RESOURCES_PER_LEASE`]
    /// members, otherwise [`LockError::ResourceCount`] is returned before any node is
    /// asked. With one member this is [`try_acquire`](Redlock::try_acquire). The nodes
    /// grant all or nothing, and the lease is extended, released and lost as a whole;
    /// each member has its own fencing token
    /// ([`fencing_token_of`](LeaseHandle::fencing_token_of)).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_redlock::{LockError, Redlock, Resource};
    ///
    /// let locker = Redlock::in_memory();
    /// // A transfer locks both accounts, whatever order it names them in.
    /// let lease = locker.try_acquire_all(["account:bob", "account:alice"]).await?;
    /// let alice = Resource::from("account:alice");
    /// assert_eq!(lease.resources(), [alice.clone(), Resource::from("account:bob")]);
    /// let alice_token = lease.fencing_token_of(&alice).expect("a member");
    /// assert_eq!(lease.fencing_tokens().len(), 2);
    ///
    /// // A transfer the other way round finds the set held.
    /// match locker.try_acquire_all(["account:alice", "account:bob"]).await {
    ///     Err(LockError::Held { resource, .. }) => assert_eq!(resource, alice),
    ///     other => panic!("expected contention, got {other:?}"),
    /// }
    /// lease.release().await;
    /// # let _ = alice_token;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn try_acquire_all<R: Into<Resource>>(
        &self,
        resources: impl IntoIterator<Item = R>,
    ) -> Result<Lease, LockError> {
        let mut set = canonical(resources)?;
        if set.len() == 1 {
            return self.try_acquire(set.remove(0)).await;
        }
        let started = metrics::started();
        let result = self.try_once(self.set_of(set)).await;
        metrics::acquisition(&result, started);
        result
    }

    /// Waits up to `timeout` for every resource of a set; see
    /// [`acquire_all_until`](Redlock::acquire_all_until).
    pub async fn acquire_all<R: Into<Resource>>(
        &self,
        resources: impl IntoIterator<Item = R>,
        timeout: std::time::Duration,
    ) -> Result<Lease, LockError> {
        let deadline = crate::lock::acquire::after(Instant::now(), timeout);
        self.acquire_all_until(resources, deadline).await
    }

    /// Waits until `deadline` for every resource of a set: the set as in
    /// [`try_acquire_all`](Redlock::try_acquire_all), the waiting as in
    /// [`acquire_until`](Redlock::acquire_until). Inside this process the set queues for
    /// each member in canonical order; across processes it retries when any member is
    /// released, or after the [`RetryPolicy`](crate::RetryPolicy)'s delay. On timeout,
    /// [`LockError::WaitTimeout`] names the member found held last.
    ///
    /// Cancellation-safe: dropping the future leaves no queue entry and no lock behind.
    pub async fn acquire_all_until<R: Into<Resource>>(
        &self,
        resources: impl IntoIterator<Item = R>,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let mut set = canonical(resources)?;
        if set.len() == 1 {
            return self.acquire_until(set.remove(0), deadline).await;
        }
        self.wait_for(self.set_of(set), Instant::now(), deadline)
            .await
    }
}

impl LeaseHandle {
    /// Every resource this lease holds, in canonical order (sorted, no duplicates): one
    /// for a lease of [`try_acquire`](Redlock::try_acquire) or
    /// [`acquire`](Redlock::acquire), the set for one of
    /// [`try_acquire_all`](Redlock::try_acquire_all).
    pub fn resources(&self) -> &[Resource] {
        self.lease_inner().resources()
    }

    /// The fencing token of one member of this lease (`None` when the lease does not
    /// hold `resource`). Each member's token follows that resource's own sequence:
    /// compare it only with other tokens of the same resource.
    pub fn fencing_token_of(&self, resource: &Resource) -> Option<FencingToken> {
        let index = self.resources().binary_search(resource).ok()?;
        self.tokens().get(index).copied().map(FencingToken::new)
    }

    /// Each resource of this lease with its fencing token, in canonical order.
    pub fn fencing_tokens(&self) -> impl ExactSizeIterator<Item = (&Resource, FencingToken)> + '_ {
        let tokens = self.tokens().iter().map(|&token| FencingToken::new(token));
        self.resources().iter().zip(tokens)
    }

    fn tokens(&self) -> &[u64] {
        &self.lease_inner().tokens
    }
}
