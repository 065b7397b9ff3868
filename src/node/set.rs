//! The node side of a lease over a set of resources: the capability ([`LockSets`]),
//! what one node is asked ([`AcquireSetRequest`]) and answers ([`AcquireSetReply`]),
//! and the fallback over the per-key calls for a node without the capability.
//!
//! A node kind that can do better (one atomic call for the whole set, as the
//! [`MemoryNode`](crate::MemoryNode), the Redis scripts and etcd's transactions do)
//! hands out [`LockSets`]; the semantics are the same either way: **all or nothing on
//! this node**.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;

use crate::error::NodeError;
use crate::node::{AcquireReply, AcquireRequest, Node, NodeFuture, Owner, ResourceKeys};

/// One call for a whole set of resources, **all or nothing on this node**: the
/// capability a node hands out with [`Node::sets`]. Without it the locker composes the
/// per-key calls (members one after the other, undone at the first one held).
pub trait LockSets: Send + Sync {
    /// Acquires every member of a set: when one member is held by someone else,
    /// nothing of the request stays held here and the answer is
    /// [`AcquireSetReply::Held`] with the first held member. Each member's fence counter
    /// follows [`acquire`](Node::acquire)'s rule, with the request's one floor.
    fn acquire_set(&self, request: &AcquireSetRequest<'_>) -> NodeFuture<AcquireSetReply>;

    /// Extends every member of a set held by `owner`, as [`extend`](Node::extend) does
    /// one; `true` only if every member was extended.
    fn extend_set(&self, keys: &[ResourceKeys], owner: &Owner, ttl: Duration) -> NodeFuture<bool>;

    /// Releases every member of a set held by `owner`, as [`release`](Node::release)
    /// does one (publishing on each member's channel unless it is empty); `true` only if
    /// every member was ours and deleted.
    fn release_set(&self, keys: &[ResourceKeys], owner: &Owner) -> NodeFuture<bool>;

    /// Raises each member's fence counter to its token (`tokens[i]` for `keys[i]`), as
    /// [`raise_fence`](Node::raise_fence) does one.
    fn raise_fences(
        &self,
        keys: &[ResourceKeys],
        tokens: &[u64],
        fence_ttl: Duration,
    ) -> NodeFuture<()>;
}

/// Arguments of [`LockSets::acquire_set`]: as [`AcquireRequest`], for several resources.
#[derive(Debug, Clone, Copy)]
pub struct AcquireSetRequest<'a> {
    /// The keys of every member, in the lease's canonical order (sorted by resource,
    /// no duplicates). Never empty.
    pub keys: &'a [ResourceKeys],
    /// The owner value of this acquisition, the same for every member.
    pub owner: &'a Owner,
    /// The lock keys' time to live.
    pub ttl: Duration,
    /// The fence counters' time to live.
    pub fence_ttl: Duration,
    /// Maintain the fence counters (see [`AcquireRequest::fencing`]).
    pub fencing: bool,
    /// The least fence value of every member (see [`AcquireRequest::fence_floor`]).
    pub fence_floor: u64,
    /// Test hook, as [`AcquireRequest`]'s.
    #[doc(hidden)]
    pub seed_only_when_missing: bool,
}

impl<'a> AcquireSetRequest<'a> {
    /// The request for one member, `keys`, with this request's settings.
    pub fn member(&self, keys: &'a ResourceKeys) -> AcquireRequest<'a> {
        AcquireRequest {
            keys,
            owner: self.owner,
            ttl: self.ttl,
            fence_ttl: self.fence_ttl,
            fencing: self.fencing,
            fence_floor: self.fence_floor,
            seed_only_when_missing: self.seed_only_when_missing,
            waiter: None,
        }
    }
}

/// One node's answer to [`LockSets::acquire_set`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcquireSetReply {
    /// Every member's lock key was set; `fences[i]` is member `i`'s fence counter now
    /// (0 for every member without fencing).
    Acquired {
        /// Each member's fence counter after the increment, in the request's order.
        fences: Vec<u64>,
    },
    /// Someone else holds at least one member: nothing of this request is held on the
    /// node.
    Held {
        /// The index (in the request's order) of the first member found held.
        member: usize,
        /// The longest remaining ttl of the held members the node saw (`None`: no ttl).
        pttl: Option<Duration>,
    },
}

/// [`LockSets::acquire_set`] without the capability: the members one after the other in the request's
/// order; at the first one held, releases those taken (without waking anyone: they were
/// never granted to a caller) and answers held. A failure releases those taken too and
/// answers the failure.
pub(crate) fn acquire_each<N: Node + ?Sized>(
    node: Arc<N>,
    request: &AcquireSetRequest<'_>,
) -> NodeFuture<AcquireSetReply> {
    let keys: Vec<ResourceKeys> = request.keys.to_vec();
    let owner = request.owner.clone();
    let settings = *request;
    let (ttl, fence_ttl, fencing) = (settings.ttl, settings.fence_ttl, settings.fencing);
    let (fence_floor, seed_only_when_missing) =
        (settings.fence_floor, settings.seed_only_when_missing);
    Box::pin(async move {
        let mut fences = Vec::with_capacity(keys.len());
        for (index, member) in keys.iter().enumerate() {
            let answer = node
                .acquire(&AcquireRequest {
                    keys: member,
                    owner: &owner,
                    ttl,
                    fence_ttl,
                    fencing,
                    fence_floor,
                    seed_only_when_missing,
                    waiter: None,
                })
                .await;
            let failure = match answer {
                Ok(AcquireReply::Acquired { fence }) => {
                    fences.push(fence);
                    continue;
                }
                Ok(AcquireReply::Held { pttl }) => Ok(AcquireSetReply::Held {
                    member: index,
                    pttl,
                }),
                // Answers only a shared acquire, never this one.
                Ok(AcquireReply::OtherMode { .. }) => Ok(AcquireSetReply::Held {
                    member: index,
                    pttl: None,
                }),
                Err(error) => Err(error),
            };
            undo(&*node, &keys[..index], &owner).await?;
            return failure;
        }
        Ok(AcquireSetReply::Acquired { fences })
    })
}

/// Releases the members taken so far by a failed [`acquire_each`], without publishing.
async fn undo<N: Node + ?Sized>(
    node: &N,
    taken: &[ResourceKeys],
    owner: &Owner,
) -> Result<(), NodeError> {
    let calls: Vec<_> = taken
        .iter()
        .map(|keys| {
            node.release(
                &ResourceKeys {
                    channel: String::new(),
                    ..keys.clone()
                },
                owner,
            )
        })
        .collect();
    join_all(calls)
        .await
        .into_iter()
        .find_map(Result::err)
        .map_or(Ok(()), Err)
}

/// [`LockSets::extend_set`] without the capability: every member, concurrently; yes only if every
/// member was extended. Every call is awaited; the first failure is the answer.
pub(crate) fn extend_each<N: Node + ?Sized>(
    node: &N,
    keys: &[ResourceKeys],
    owner: &Owner,
    ttl: Duration,
) -> NodeFuture<bool> {
    every(
        keys.iter()
            .map(|keys| node.extend(keys, owner, ttl))
            .collect(),
    )
}

/// [`LockSets::release_set`] without the capability: every member, concurrently; yes only if every
/// member was ours and deleted.
pub(crate) fn release_each<N: Node + ?Sized>(
    node: &N,
    keys: &[ResourceKeys],
    owner: &Owner,
) -> NodeFuture<bool> {
    every(keys.iter().map(|keys| node.release(keys, owner)).collect())
}

/// [`LockSets::raise_fences`] without the capability: every member, concurrently.
pub(crate) fn raise_each<N: Node + ?Sized>(
    node: &N,
    keys: &[ResourceKeys],
    tokens: &[u64],
    fence_ttl: Duration,
) -> NodeFuture<()> {
    let calls: Vec<_> = keys
        .iter()
        .zip(tokens)
        .map(|(keys, &token)| node.raise_fence(keys, token, fence_ttl))
        .collect();
    Box::pin(async move {
        join_all(calls)
            .await
            .into_iter()
            .find_map(Result::err)
            .map_or(Ok(()), Err)
    })
}

fn every(calls: Vec<NodeFuture<bool>>) -> NodeFuture<bool> {
    Box::pin(async move {
        let mut all = true;
        for answer in join_all(calls).await {
            all &= answer?;
        }
        Ok(all)
    })
}
