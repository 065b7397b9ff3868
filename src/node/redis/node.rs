//! The one `Node` implementation of the three Redis kinds. They run the same operations
//! (`call/`, `records.rs`) and differ only in how a call reaches a server: a [`Route`]
//! (`standalone.rs`: one server's connection; `sentinel/`: the master the sentinels
//! name; `cluster.rs`: redis-rs's cluster connection, which routes by slot).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;

use crate::error::NodeError;
use crate::node::redis::call::modes::{self, SharedAcquireCall};
use crate::node::redis::call::set;
use crate::node::redis::call::{
    Acquire as AcquireCall, ExtendCall, ExtendManyCall, ListenCall, Op, RaiseFenceCall,
    ReleaseCall, ReplicaWait,
};
use crate::node::redis::records::{ClaimCall, DiscardCall, ReadCall, StoreCall};
use crate::node::{
    Acquire, AcquireReply, AcquireRequest, AcquireSetReply, AcquireSetRequest, Capabilities,
    ClaimReply, ClaimRequest, ExtendEntry, Hold, LockMode, Node, NodeFuture, PerKey, Record,
    RecordStore, Release, ReleaseSignal, ResourceKeys, ServerSetup, SharedRequest, StoreReply,
    StoreRequest, Vote, Waiter,
};

/// How a Redis node's calls reach a server.
pub(crate) trait Route: Send + Sync + 'static {
    /// A call's keys may live on different servers (Cluster): a release publishes with
    /// `SPUBLISH`, and the set calls and batched extends go key by key, since one script
    /// cannot reach keys of several slots.
    const SHARDED: bool;

    fn name(&self) -> &str;

    fn address(&self) -> &str;

    /// Runs `op` on a connection to the server that owns its keys.
    fn run<'a, O: Op>(
        &'a self,
        op: &'a O,
        wait: Option<ReplicaWait>,
    ) -> impl Future<Output = Result<O::Output, NodeError>> + Send + 'a;

    /// See [`Node::subscribe`].
    fn subscribe(self: &Arc<Self>, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal>;

    /// See [`Node::server_ids`].
    fn server_ids(self: Arc<Self>) -> NodeFuture<Vec<String>>;

    /// See [`Node::server_setup`].
    fn server_setup(self: Arc<Self>, probe: ResourceKeys) -> NodeFuture<Vec<ServerSetup>>;
}

/// A Redis node over route `R`: the route, shared by every clone, and this handle's
/// replica acknowledgement.
pub(crate) struct Redis<R> {
    pub(crate) route: Arc<R>,
    pub(crate) wait: Option<ReplicaWait>,
}

impl<R> Clone for Redis<R> {
    fn clone(&self) -> Self {
        Redis {
            route: self.route.clone(),
            wait: self.wait,
        }
    }
}

impl<R: Route> Redis<R> {
    pub(crate) fn new(route: R) -> Self {
        Redis {
            route: Arc::new(route),
            wait: None,
        }
    }

    /// One operation, as every call makes it: the box owns the operation and borrows it
    /// to the route's future, so it holds it once.
    fn call<O: Op>(&self, op: O) -> NodeFuture<O::Output> {
        let (route, wait) = (self.route.clone(), self.wait);
        Box::pin(async move { route.run(&op, wait).await })
    }

    /// A single resource's acquire operation, its answer read as a vote (in the same
    /// box: a box per call is what the allocation benchmark counts).
    fn vote<O: Op<Output = AcquireReply>>(&self, op: O) -> NodeFuture<Vote> {
        let (route, wait) = (self.route.clone(), self.wait);
        Box::pin(async move { route.run(&op, wait).await.map(vote) })
    }
}

/// The node calls, mapped onto the operations of `call/`: one resource exclusively is
/// the acquire script (with the wait queue), a set is the set scripts (key by key on a
/// Cluster, whose members live in different slots), a shared holder is the shared
/// scripts.
impl<R: Route> Node for Redis<R> {
    fn name(&self) -> &str {
        self.route.name()
    }

    fn address(&self) -> Option<&str> {
        Some(self.route.address())
    }

    fn server_ids(&self) -> NodeFuture<Vec<String>> {
        self.route.clone().server_ids()
    }

    fn server_setup(&self, probe: &ResourceKeys) -> NodeFuture<Vec<ServerSetup>> {
        self.route.clone().server_setup(probe.clone())
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }

    fn acquire(&self, request: &Acquire<'_>) -> NodeFuture<Vote> {
        let one = |keys| AcquireRequest {
            keys,
            owner: request.owner,
            ttl: request.ttl,
            fence_ttl: request.fence_ttl,
            fencing: request.fencing,
            fence_floor: request.fence_floor,
            seed_only_when_missing: request.seed_only_when_missing,
            waiter: request.waiter,
        };
        match (request.mode, request.keys) {
            (LockMode::Exclusive, [keys]) => self.vote(AcquireCall::new(&one(keys), R::SHARDED)),
            (LockMode::Exclusive, keys) if R::SHARDED => {
                let calls: Vec<_> = keys
                    .iter()
                    .map(|keys| self.vote(AcquireCall::new(&one(keys), true)))
                    .collect();
                acquire_each(self.clone(), request, calls)
            }
            (LockMode::Exclusive, keys) => {
                let call = self.call(set::acquire_set(&AcquireSetRequest {
                    keys,
                    owner: request.owner,
                    ttl: request.ttl,
                    fence_ttl: request.fence_ttl,
                    fencing: request.fencing,
                    fence_floor: request.fence_floor,
                    seed_only_when_missing: request.seed_only_when_missing,
                }));
                Box::pin(async move {
                    Ok(match call.await? {
                        AcquireSetReply::Acquired { fences } => Vote::Granted {
                            fences: fences.into(),
                        },
                        AcquireSetReply::Held { member, pttl } => Vote::Held { member, pttl },
                    })
                })
            }
            (mode, [keys]) => self.vote(SharedAcquireCall::new(&SharedRequest {
                keys,
                owner: request.owner,
                mode,
                ttl: request.ttl,
                fence_ttl: request.fence_ttl,
                fencing: request.fencing,
                fence_floor: request.fence_floor,
            })),
            _ => unsupported_set(),
        }
    }

    fn extend(
        &self,
        holds: &[Hold<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
        if let [hold] = holds {
            // A lease's own extend: the one script for its shape.
            let call = self.extend_one(hold, ttl);
            return Box::pin(async move { Ok(vec![call.await]) });
        }
        // A renewal batch: the exclusive keys in one script (key by key on a Cluster),
        // the shared holders beside it, then one answer per hold.
        let exclusive: Vec<ExtendEntry<'_>> = holds
            .iter()
            .filter(|hold| hold.mode.is_exclusive())
            .flat_map(|hold| {
                hold.keys.iter().map(|keys| ExtendEntry {
                    keys,
                    owner: hold.owner.clone(),
                })
            })
            .collect();
        let exclusive: NodeFuture<Vec<Result<bool, NodeError>>> = if R::SHARDED {
            let calls: Vec<_> = exclusive
                .iter()
                .map(|entry| self.call(ExtendCall::new(entry.keys, &entry.owner, ttl)))
                .collect();
            Box::pin(async move { Ok(join_all(calls).await) })
        } else if exclusive.is_empty() {
            Box::pin(std::future::ready(Ok(Vec::new())))
        } else {
            self.call(ExtendManyCall::new(&exclusive, ttl))
        };
        let shared: Vec<_> = holds
            .iter()
            .filter(|hold| !hold.mode.is_exclusive())
            .map(|hold| self.extend_one(hold, ttl))
            .collect();
        let sizes: Vec<Option<usize>> = holds
            .iter()
            .map(|hold| hold.mode.is_exclusive().then_some(hold.keys.len()))
            .collect();
        Box::pin(async move {
            let (exclusive, shared) = futures_util::future::join(exclusive, join_all(shared)).await;
            let (mut exclusive, mut shared) = (exclusive?.into_iter(), shared.into_iter());
            Ok(sizes
                .into_iter()
                .map(|size| match size {
                    None => shared.next().unwrap_or(Ok(false)),
                    Some(keys) => every((&mut exclusive).take(keys)),
                })
                .collect())
        })
    }

    fn release(&self, hold: &Hold<'_>, how: Release<'_>) -> NodeFuture<bool> {
        let quiet;
        let keys = match how {
            Release::Quiet => {
                // A release that wakes nobody: the scripts' empty channel.
                quiet = hold.keys.iter().map(silent).collect::<Vec<_>>();
                &quiet[..]
            }
            _ => hold.keys,
        };
        let owner = hold.owner;
        match (hold.mode.is_exclusive(), keys, how) {
            (false, [keys], _) => self.call(modes::release_shared(keys, owner, R::SHARDED)),
            (true, [keys], Release::AsWaiter(waiter)) => {
                self.call(ReleaseCall::as_waiter(keys, owner, waiter, R::SHARDED))
            }
            (true, [keys], Release::HandBack(waiter)) => {
                self.call(ReleaseCall::hand_back(keys, owner, waiter, R::SHARDED))
            }
            (true, [keys], _) => self.call(ReleaseCall::new(keys, owner, R::SHARDED)),
            (true, keys, _) if R::SHARDED => {
                let calls: Vec<_> = keys
                    .iter()
                    .map(|keys| self.call(ReleaseCall::new(keys, owner, true)))
                    .collect();
                Box::pin(async move { every(join_all(calls).await) })
            }
            (true, keys, _) => self.call(set::release_set(keys, owner, false)),
            (false, _, _) => unsupported_set(),
        }
    }

    fn raise_fences(
        &self,
        keys: &[ResourceKeys],
        tokens: &[u64],
        fence_ttl: Duration,
    ) -> NodeFuture<()> {
        match (keys, tokens) {
            ([keys], [token]) => self.call(RaiseFenceCall::new(keys, *token, fence_ttl)),
            _ if R::SHARDED => {
                let calls: Vec<_> = keys
                    .iter()
                    .zip(tokens)
                    .map(|(keys, &token)| self.call(RaiseFenceCall::new(keys, token, fence_ttl)))
                    .collect();
                Box::pin(async move { join_all(calls).await.into_iter().collect() })
            }
            _ => self.call(set::raise_fences(keys, tokens, fence_ttl)),
        }
    }

    fn subscribe(&self, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
        self.route.subscribe(keys)
    }

    fn leave_queue(&self, keys: &ResourceKeys, waiter: &Waiter) -> NodeFuture<()> {
        let leave = self.call(ReleaseCall::leave(keys, waiter, R::SHARDED));
        Box::pin(async move { leave.await.map(|_| ()) })
    }

    fn listen_for_release(&self, keys: &ResourceKeys, ttl: Duration) -> NodeFuture<()> {
        self.call(ListenCall::new(keys, ttl))
    }

    fn records(&self) -> Option<&dyn RecordStore> {
        Some(self)
    }
}

impl<R: Route> Redis<R> {
    /// One hold's extend, by its shape: the single-key script, the set script (key by
    /// key on a Cluster), or the shared holder's.
    fn extend_one(&self, hold: &Hold<'_>, ttl: Duration) -> NodeFuture<bool> {
        let owner = hold.owner;
        match (hold.mode.is_exclusive(), hold.keys) {
            (true, [keys]) => self.call(ExtendCall::new(keys, owner, ttl)),
            (true, keys) if R::SHARDED => {
                let calls: Vec<_> = keys
                    .iter()
                    .map(|keys| self.call(ExtendCall::new(keys, owner, ttl)))
                    .collect();
                Box::pin(async move { every(join_all(calls).await) })
            }
            (true, keys) => self.call(set::extend_set(keys, owner, ttl)),
            (false, [keys]) => self.call(modes::extend_shared(keys, owner, ttl)),
            (false, _) => unsupported_set(),
        }
    }
}

/// `true` only if every answer is; a `false` wins over a failure (that key is not
/// ours, whatever the others say), a failure over `true`.
fn every(answers: impl IntoIterator<Item = Result<bool, NodeError>>) -> Result<bool, NodeError> {
    let mut failure = None;
    let mut all = true;
    for answer in answers {
        match answer {
            Ok(yes) => all &= yes,
            Err(error) => failure = Some(error),
        }
    }
    match failure {
        Some(error) if all => Err(error),
        _ => Ok(all),
    }
}

fn silent(keys: &ResourceKeys) -> ResourceKeys {
    ResourceKeys {
        channel: String::new(),
        ..keys.clone()
    }
}

fn unsupported_set<T: Send + 'static>() -> NodeFuture<T> {
    Box::pin(std::future::ready(Err(NodeError::Unsupported(
        "a set of resources in a shared mode".into(),
    ))))
}

/// An operation's single-resource answer as a vote.
fn vote(reply: AcquireReply) -> Vote {
    match reply {
        AcquireReply::Acquired { fence } => Vote::Granted {
            fences: PerKey::one(fence),
        },
        AcquireReply::Held { pttl } => Vote::Held { member: 0, pttl },
        AcquireReply::OtherMode { held } => Vote::OtherMode { held },
    }
}

/// A Cluster's set: the members one after the other in the request's order (each its
/// own slot); at the first one held, the members taken are released without waking
/// anyone (nothing was granted to a caller) and the answer is held. A failure releases
/// them too and answers the failure.
fn acquire_each<R: Route>(
    node: Redis<R>,
    request: &Acquire<'_>,
    calls: Vec<NodeFuture<Vote>>,
) -> NodeFuture<Vote> {
    let keys: Vec<ResourceKeys> = request.keys.iter().map(silent).collect();
    let owner = request.owner.clone();
    Box::pin(async move {
        let mut fences = Vec::with_capacity(keys.len());
        for (index, call) in calls.into_iter().enumerate() {
            let failure = match call.await {
                Ok(Vote::Granted { fences: fence }) => {
                    fences.extend_from_slice(&fence);
                    continue;
                }
                Ok(Vote::Held { pttl, .. }) => Ok(Vote::Held {
                    member: index,
                    pttl,
                }),
                Ok(other) => Ok(other),
                Err(error) => Err(error),
            };
            let undo: Vec<_> = keys[..index]
                .iter()
                .map(|keys| node.call(ReleaseCall::new(keys, &owner, true)))
                .collect();
            if let Some(error) = join_all(undo).await.into_iter().find_map(Result::err) {
                return Err(error);
            }
            return failure;
        }
        Ok(Vote::Granted {
            fences: fences.into(),
        })
    })
}

/// Outcome records (idempotent replay, `records.rs`). The record key carries the lock
/// key's hash tag, so a cluster routes each call, `WAIT` included, to the shard that
/// owns the lock; a Sentinel node follows the master as for the locks. Claims and
/// stores honour `wait_for_replicas`: a record counts only once the replicas a failover
/// may promote have it.
impl<R: Route> RecordStore for Redis<R> {
    fn read_record(&self, keys: &ResourceKeys) -> NodeFuture<Option<Record>> {
        self.call(ReadCall(keys.clone()))
    }

    fn claim_record(&self, request: &ClaimRequest<'_>) -> NodeFuture<ClaimReply> {
        self.call(ClaimCall::new(request))
    }

    fn store_record(&self, request: &StoreRequest<'_>) -> NodeFuture<StoreReply> {
        self.call(StoreCall::new(request))
    }

    fn discard_record(&self, keys: &ResourceKeys, token: u64) -> NodeFuture<bool> {
        self.call(DiscardCall::new(keys, token))
    }
}

/// `Node` for a public node type that holds a [`Redis`] as `node`: each call, and each
/// capability, is the `Redis`'s.
macro_rules! forward_node {
    ($node:ty) => {
        const _: () = {
            use std::time::Duration;

            use $crate::error::NodeError;
            use $crate::node::{
                Acquire, Capabilities, Hold, Node, NodeFuture, RecordStore, Release, ReleaseSignal,
                ResourceKeys, ServerSetup, Vote, Waiter,
            };

            impl Node for $node {
                fn name(&self) -> &str {
                    self.node.name()
                }
                fn address(&self) -> Option<&str> {
                    self.node.address()
                }
                fn server_ids(&self) -> NodeFuture<Vec<String>> {
                    self.node.server_ids()
                }
                fn server_setup(&self, probe: &ResourceKeys) -> NodeFuture<Vec<ServerSetup>> {
                    self.node.server_setup(probe)
                }
                fn capabilities(&self) -> Capabilities {
                    self.node.capabilities()
                }
                fn acquire(&self, request: &Acquire<'_>) -> NodeFuture<Vote> {
                    self.node.acquire(request)
                }
                fn extend(
                    &self,
                    holds: &[Hold<'_>],
                    ttl: Duration,
                ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
                    self.node.extend(holds, ttl)
                }
                fn release(&self, hold: &Hold<'_>, how: Release<'_>) -> NodeFuture<bool> {
                    self.node.release(hold, how)
                }
                fn raise_fences(
                    &self,
                    keys: &[ResourceKeys],
                    tokens: &[u64],
                    fence_ttl: Duration,
                ) -> NodeFuture<()> {
                    self.node.raise_fences(keys, tokens, fence_ttl)
                }
                fn subscribe(&self, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
                    self.node.subscribe(keys)
                }
                fn leave_queue(&self, keys: &ResourceKeys, waiter: &Waiter) -> NodeFuture<()> {
                    self.node.leave_queue(keys, waiter)
                }
                fn listen_for_release(&self, keys: &ResourceKeys, ttl: Duration) -> NodeFuture<()> {
                    self.node.listen_for_release(keys, ttl)
                }
                fn records(&self) -> Option<&dyn RecordStore> {
                    self.node.records()
                }
            }
        };
    };
}

pub(crate) use forward_node;
