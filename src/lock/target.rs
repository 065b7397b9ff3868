//! What one acquisition takes: one resource or a set of them (a set of one), in a
//! [`LockMode`]. The engine has one path (`acquire.rs` the waiting, `attempt.rs` one
//! round, `round.rs` the fan-out) over a [`Target`]; a node call carries its keys and
//! mode as data. A single resource keeps everything inline ([`PerKey`]): its name,
//! keys, fence values and turns allocate no list.

use super::quorum;
use crate::node::{
    Hold, LockMode, Node, NodeFuture, Owner, PerKey, Release, Resource, ResourceKeys, Waiter,
};

/// One resource or a set, in canonical order, and the mode (a set's is exclusive).
#[derive(Clone)]
pub(crate) struct Target {
    resources: PerKey<Resource>,
    keys: PerKey<ResourceKeys>,
    mode: LockMode,
}

impl Target {
    /// One resource in `mode`.
    pub(crate) fn one(prefix: &str, resource: Resource, mode: LockMode) -> Self {
        let keys = ResourceKeys::new(prefix, &resource);
        Target {
            resources: PerKey::one(resource),
            keys: PerKey::one(keys),
            mode,
        }
    }

    /// The set of `resources`, already in canonical order, exclusive.
    pub(crate) fn set(prefix: &str, resources: Vec<Resource>) -> Self {
        let keys = PerKey::map(&resources, |r| ResourceKeys::new(prefix, r));
        Target {
            resources: resources.into(),
            keys,
            mode: LockMode::Exclusive,
        }
    }

    /// Whether a waiter joins the nodes' wait queues: only one resource's exclusive
    /// waiter does; a set's or a shared holder's is woken by every release of a member.
    pub(crate) fn queues(&self) -> bool {
        self.mode.is_exclusive() && self.keys.len() == 1
    }

    /// Whether the target shares its resource (a reader, a permit): then it takes a
    /// local queue of its own rather than the resource's, which has one holder at a time.
    pub(crate) fn shares(&self) -> bool {
        !self.mode.is_exclusive()
    }

    pub(crate) fn mode(&self) -> LockMode {
        self.mode
    }

    /// The votes this target needs among `nodes` nodes (see [`quorum::for_mode`]).
    pub(crate) fn quorum(&self, nodes: usize) -> usize {
        quorum::for_mode(nodes, self.mode)
    }

    /// The members, in canonical order (never empty).
    pub(crate) fn resources(&self) -> &[Resource] {
        &self.resources
    }

    /// Each member's keys, in canonical order.
    pub(crate) fn keys(&self) -> &[ResourceKeys] {
        &self.keys
    }

    /// `f` of every member, in canonical order.
    pub(crate) fn each<X>(&self, f: impl FnMut(&Resource) -> X) -> PerKey<X> {
        PerKey::map(&self.resources, f)
    }

    /// What a lease over this target holds on a node, as `owner`.
    pub(crate) fn hold<'a>(&'a self, owner: &'a Owner) -> Hold<'a> {
        Hold {
            keys: &self.keys,
            owner,
            mode: self.mode,
        }
    }

    /// Releases a lease; `waiter`: its attempt was a waiter's (see
    /// [`Release::AsWaiter`]).
    pub(crate) fn release(
        &self,
        node: &dyn Node,
        owner: &Owner,
        waiter: Option<&Waiter>,
    ) -> NodeFuture<bool> {
        let how = match waiter {
            Some(waiter) if self.queues() => Release::AsWaiter(waiter),
            _ => Release::Wake,
        };
        node.release(&self.hold(owner), how)
    }

    /// Undoes a failed attempt on `node`: one resource's exclusive attempt is released
    /// as a lease is (on a node with a wait queue, a key taken from the queue's head
    /// goes on to the next waiter) or, for a waiter, which keeps its turn, handed back
    /// to it; a set's or a shared holder's wakes nobody, as nothing was granted to anyone.
    pub(crate) fn undo(
        &self,
        node: &dyn Node,
        owner: &Owner,
        waiter: Option<&Waiter>,
    ) -> NodeFuture<bool> {
        let how = match waiter {
            _ if !self.queues() => Release::Quiet,
            Some(waiter) => Release::HandBack(waiter),
            None => Release::Wake,
        };
        node.release(&self.hold(owner), how)
    }
}
