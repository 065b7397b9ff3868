//! What the engine calls of a node: the capability's call when the node has it, and
//! when it has not the fallback its contract describes (per-key calls for a set, a
//! plain release for a node without a wait queue). Written once here, so the engine
//! never branches on a node's capabilities.

use std::sync::Arc;
use std::time::Duration;

use crate::node::set::{acquire_each, extend_each, raise_each, release_each};
use crate::node::{
    AcquireReply, AcquireSetReply, AcquireSetRequest, ExtendEntry, Node, NodeError, NodeFuture,
    Owner, ResourceKeys, SharedRequest, Waiter,
};

fn done() -> NodeFuture<()> {
    Box::pin(std::future::ready(Ok(())))
}

/// A shared or counted call on a node without the capability: a locker in those modes
/// is refused when it checks them (`Redlock::check_mode`), so only a caller that did
/// not check meets this.
fn no_shared_holders<T: Send + 'static>() -> NodeFuture<T> {
    Box::pin(std::future::ready(Err(NodeError::Unsupported(
        "shared and counted leases".into(),
    ))))
}

/// The calls of the capabilities, on any node.
pub(crate) trait NodeCalls {
    /// By `Arc`: without the capability, the calls follow one another in a future that
    /// owns the node.
    fn acquire_set(self: Arc<Self>, request: &AcquireSetRequest<'_>)
        -> NodeFuture<AcquireSetReply>;
    fn extend_set(&self, keys: &[ResourceKeys], owner: &Owner, ttl: Duration) -> NodeFuture<bool>;
    fn release_set(&self, keys: &[ResourceKeys], owner: &Owner) -> NodeFuture<bool>;
    fn raise_fences(
        &self,
        keys: &[ResourceKeys],
        tokens: &[u64],
        fence_ttl: Duration,
    ) -> NodeFuture<()>;
    fn release_as_waiter(
        &self,
        keys: &ResourceKeys,
        owner: &Owner,
        waiter: &Waiter,
    ) -> NodeFuture<bool>;
    fn hand_back(&self, keys: &ResourceKeys, owner: &Owner, waiter: &Waiter) -> NodeFuture<bool>;
    fn leave_queue(&self, keys: &ResourceKeys, waiter: &Waiter) -> NodeFuture<()>;
    fn listen_for_release(&self, keys: &ResourceKeys, ttl: Duration) -> NodeFuture<()>;
    fn acquire_shared(&self, request: &SharedRequest<'_>) -> NodeFuture<AcquireReply>;
    fn extend_shared(&self, keys: &ResourceKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool>;
    fn release_shared(&self, keys: &ResourceKeys, owner: &Owner) -> NodeFuture<bool>;
    fn extend_shared_many(
        &self,
        entries: &[ExtendEntry<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>>;
}

impl NodeCalls for dyn Node {
    fn acquire_set(
        self: Arc<Self>,
        request: &AcquireSetRequest<'_>,
    ) -> NodeFuture<AcquireSetReply> {
        if let Some(sets) = self.sets() {
            return sets.acquire_set(request);
        }
        acquire_each(self, request)
    }

    fn extend_set(&self, keys: &[ResourceKeys], owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        match self.sets() {
            Some(sets) => sets.extend_set(keys, owner, ttl),
            None => extend_each(self, keys, owner, ttl),
        }
    }

    fn release_set(&self, keys: &[ResourceKeys], owner: &Owner) -> NodeFuture<bool> {
        match self.sets() {
            Some(sets) => sets.release_set(keys, owner),
            None => release_each(self, keys, owner),
        }
    }

    fn raise_fences(
        &self,
        keys: &[ResourceKeys],
        tokens: &[u64],
        fence_ttl: Duration,
    ) -> NodeFuture<()> {
        match self.sets() {
            Some(sets) => sets.raise_fences(keys, tokens, fence_ttl),
            None => raise_each(self, keys, tokens, fence_ttl),
        }
    }

    fn release_as_waiter(
        &self,
        keys: &ResourceKeys,
        owner: &Owner,
        waiter: &Waiter,
    ) -> NodeFuture<bool> {
        match self.wait_queue() {
            Some(queue) => queue.release_as_waiter(keys, owner, waiter),
            None => self.release(keys, owner),
        }
    }

    fn hand_back(&self, keys: &ResourceKeys, owner: &Owner, waiter: &Waiter) -> NodeFuture<bool> {
        match self.wait_queue() {
            Some(queue) => queue.hand_back(keys, owner, waiter),
            None => self.release(keys, owner),
        }
    }

    fn leave_queue(&self, keys: &ResourceKeys, waiter: &Waiter) -> NodeFuture<()> {
        match self.wait_queue() {
            Some(queue) => queue.leave_queue(keys, waiter),
            None => done(),
        }
    }

    fn listen_for_release(&self, keys: &ResourceKeys, ttl: Duration) -> NodeFuture<()> {
        match self.wait_queue() {
            Some(queue) => queue.listen_for_release(keys, ttl),
            None => done(),
        }
    }

    fn acquire_shared(&self, request: &SharedRequest<'_>) -> NodeFuture<AcquireReply> {
        match self.shared_modes() {
            Some(modes) => modes.acquire_shared(request),
            None => no_shared_holders(),
        }
    }

    fn extend_shared(&self, keys: &ResourceKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        match self.shared_modes() {
            Some(modes) => modes.extend_shared(keys, owner, ttl),
            None => no_shared_holders(),
        }
    }

    fn release_shared(&self, keys: &ResourceKeys, owner: &Owner) -> NodeFuture<bool> {
        match self.shared_modes() {
            Some(modes) => modes.release_shared(keys, owner),
            None => no_shared_holders(),
        }
    }

    fn extend_shared_many(
        &self,
        entries: &[ExtendEntry<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
        match self.shared_modes() {
            Some(modes) => modes.extend_shared_many(entries, ttl),
            None => no_shared_holders(),
        }
    }
}
