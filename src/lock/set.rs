//! One lease over a set of resources: a transfer that debits one account and credits
//! another, an order that reserves stock in several warehouses.
//!
//! [`Redlock::try_acquire_all`] and [`Redlock::acquire_all`] take every member or none,
//! with one owner value, one validity and one watchdog for the whole set, and one
//! fencing token per member ([`LeaseHandle::fencing_token_of`]), each following its
//! resource's own counter exactly as a single-resource lease's token does (see
//! [`fencing`](crate::fencing)). The lease is extended, released and lost as a whole:
//! when a majority of nodes no longer holds *every* member, the lease is lost.
//!
//! # The set
//!
//! The members are put in **canonical order**: sorted by resource, duplicates removed
//! (`["b", "a", "b"]` is the set `{a, b}`). A set has 1 to
//! [`MAX_RESOURCES_PER_LEASE`] members; an empty or larger one is refused with
//! [`LockError::ResourceCount`] before any node is asked. A set of one resource *is* a
//! single-resource lease: same calls, same scripts, same cost as
//! [`Redlock::try_acquire`].
//!
//! # Why overlapping sets never deadlock
//!
//! Two requests that name `{a, b}` in opposite orders must not each end up holding one
//! member and waiting for the other. Two rules make that impossible:
//!
//! - **All or nothing on each node.** A node grants the whole set or nothing of it
//!   ([`Node::acquire`](crate::node::Node::acquire) with a set): a node that finds one member
//!   held keeps nothing of the request. A round that misses a majority releases
//!   whatever it got, as a single-resource round does, and the caller waits or retries
//!   holding nothing on any node. Nobody ever holds part of a set while waiting for the
//!   rest, so no cycle of waiters can form at the nodes; the split votes two sets can
//!   cause (each wins some nodes) end as a single resource's do, with a randomised
//!   retry.
//! - **Canonical order in the process.** Inside one process, callers queue for each
//!   resource ([`LockOptions::max_waiters`](crate::LockOptions::max_waiters)); a set
//!   takes its members' local places one after the other *in canonical order*, so
//!   every caller takes them in the same global order and no two wait for each other
//!   in a circle.
//!
//! # One call per node, where the store allows it
//!
//! Every node kind takes a set in its calls of [`Node`](crate::node::Node), as well as it can:
//!
//! | node | acquire / extend / release of a set |
//! |---|---|
//! | [`MemoryNode`](crate::MemoryNode) | one step under its lock |
//! | [`RedisNode`](crate::RedisNode), [`SentinelNode`](crate::SentinelNode) | one Lua script each (`acquire.lua` checks every member before it writes any, then sets them all, each fence counter by `fence_rule.lua`) |
//! | `EtcdNode` (feature `etcd`) | one transaction each (`create_revision == 0` compared on every member), the members on one etcd lease |
//! | `PostgresNode` (feature `postgres`) | one statement each over every member's row; an acquire refused at a member is rolled back whole |
//! | [`ClusterNode`](crate::ClusterNode) | the per-key scripts, member after member in canonical order |
//!
//! A Redis Cluster cannot run one script over the members: each resource is its own
//! hash tag, so the members live in different slots (on different masters), and a
//! script may only touch keys of one slot. Grouping the members per slot would make
//! each group atomic but not the set, which still needs the undo path below, so the
//! cluster node acquires the members in canonical order and, at the
//! first one held, releases those it took (without waking anyone) and answers held.
//! The node's answer is all or nothing all the same; what it loses is atomicity during
//! the call (another client may see a member taken for a round trip) and one round trip
//! per member.
//!
//! Waiting ([`Redlock::acquire_all`]) subscribes to the release channel of every
//! member and retries when any of them is released, under the same
//! [`RetryPolicy`](crate::RetryPolicy) as a single resource.

use tokio::time::Instant;

use crate::lock::lease::LeaseHandle;
use crate::lock::target::Target;
use crate::lock::{metrics, Lease, LockError, Redlock};
use crate::node::Resource;
use crate::FencingToken;

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
        let started = metrics::Started::now();
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
        let deadline = Instant::now()
            .checked_add(timeout)
            .unwrap_or_else(crate::lock::acquire::far_future);
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
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tower_redlock::Redlock;
    ///
    /// let locker = Redlock::in_memory();
    /// let first = locker.acquire_all(["stock:a", "stock:b"], Duration::from_secs(1)).await?;
    /// let waiter = {
    ///     let locker = locker.clone();
    ///     tokio::spawn(async move {
    ///         locker.acquire_all(["stock:b", "stock:c"], Duration::from_secs(5)).await
    ///     })
    /// };
    /// first.release().await; // hands `stock:b` over to the waiter
    /// let second = waiter.await??;
    /// assert_eq!(second.resources().len(), 2);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn acquire_all_until<R: Into<Resource>>(
        &self,
        resources: impl IntoIterator<Item = R>,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let mut set = canonical(resources)?;
        if set.len() == 1 {
            return self.acquire_until(set.remove(0), deadline).await;
        }
        let started = Instant::now();
        let first = set[0].clone();
        let waiting = self.queue_and_acquire(self.set_of(set), started, deadline);
        let result = self.unless_draining(&first, waiting).await;
        metrics::acquisition(&result, metrics::Started::at(started));
        result
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
        self.lease_inner().members.tokens()
    }
}
