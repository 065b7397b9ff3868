//! The one `Node` implementation of the three Redis kinds. They run the same operations
//! (`call/`, `records.rs`) and differ only in how a call reaches a server: a [`Route`]
//! (`standalone.rs`: one server's connection; `sentinel/`: the master the sentinels
//! name; `cluster.rs`: redis-rs's cluster connection, which routes by slot).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::error::NodeError;
use crate::node::redis::call::{
    Acquire, Acquisition, ExtendCall, Grant, Hand, ListenCall, Op, RaiseFences, ReleaseCall,
    ReplicaWait,
};
use crate::node::redis::records::{ClaimCall, DiscardCall, ReadCall, StoreCall};
use crate::node::{
    AcquireReply, AcquireRequest, AcquireSetReply, AcquireSetRequest, ClaimReply, ClaimRequest,
    ExtendEntry, LockSets, Node, NodeFuture, Owner, Record, RecordStore, ReleaseSignal,
    ResourceKeys, ServerSetup, SharedModes, SharedRequest, StoreReply, StoreRequest, WaitQueue,
    Waiter,
};

/// How a Redis node's calls reach a server.
pub(crate) trait Route: Send + Sync + 'static {
    /// A call's keys may live on different servers (Cluster): a release publishes with
    /// `SPUBLISH`, and the set calls and `extend_many` go key by key, since one script
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

    /// One operation, its answer mapped by `f` (no second box).
    fn call_map<O: Op, T: Send + 'static>(
        &self,
        op: O,
        f: fn(O::Output) -> Result<T, NodeError>,
    ) -> NodeFuture<T> {
        let (route, wait) = (self.route.clone(), self.wait);
        Box::pin(async move { route.run(&op, wait).await.and_then(f) })
    }

    /// Any acquisition (see [`Acquisition`]), its answer as `T`.
    fn acquisition<T: From<Grant> + Send + 'static>(&self, acq: &Acquisition<'_>) -> NodeFuture<T> {
        self.call_map(Acquire::new(acq, R::SHARDED), |grant| Ok(T::from(grant)))
    }

    /// One hold of `keys` released (a shared holder's when `shared`), with what it does
    /// for a waiter.
    fn release_hold(
        &self,
        keys: &[ResourceKeys],
        owner: &Owner,
        hand: Hand<'_>,
        shared: bool,
    ) -> NodeFuture<bool> {
        let op = ReleaseCall::new(keys, owner.as_str(), hand, shared, R::SHARDED);
        self.call(op)
    }
}

/// Yes only if every hold was still ours (and so extended).
fn all_extended(answers: Vec<Result<bool, NodeError>>) -> Result<bool, NodeError> {
    answers
        .into_iter()
        .try_fold(true, |all, answer| answer.map(|ours| all && ours))
}

impl<R: Route> Node for Redis<R> {
    fn name(&self) -> &str {
        self.route.name()
    }

    fn acquire(&self, request: &AcquireRequest<'_>) -> NodeFuture<AcquireReply> {
        self.acquisition(&request.into())
    }

    fn extend(&self, keys: &ResourceKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        self.call_map(ExtendCall::new([(keys, owner)], ttl, false), all_extended)
    }

    fn extend_many(
        &self,
        entries: &[ExtendEntry<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
        if R::SHARDED {
            let calls: Vec<_> = entries
                .iter()
                .map(|entry| self.extend(entry.keys, &entry.owner, ttl))
                .collect();
            return Box::pin(async move { Ok(futures_util::future::join_all(calls).await) });
        }
        self.call(ExtendCall::new(
            entries.iter().map(|e| (e.keys, &e.owner)),
            ttl,
            false,
        ))
    }

    fn release(&self, keys: &ResourceKeys, owner: &Owner) -> NodeFuture<bool> {
        self.release_hold(std::slice::from_ref(keys), owner, Hand::Next, false)
    }

    fn raise_fence(&self, keys: &ResourceKeys, token: u64, fence_ttl: Duration) -> NodeFuture<()> {
        self.raise_fences(std::slice::from_ref(keys), &[token], fence_ttl)
    }

    fn subscribe(&self, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
        self.route.subscribe(keys)
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

    /// A Cluster cannot run one script over keys of several slots (each resource is its
    /// own hash tag): its sets are the engine's member-by-member calls.
    fn sets(&self) -> Option<&dyn LockSets> {
        (!R::SHARDED).then_some(self as &dyn LockSets)
    }

    fn wait_queue(&self) -> Option<&dyn WaitQueue> {
        Some(self)
    }

    fn records(&self) -> Option<&dyn RecordStore> {
        Some(self)
    }

    fn shared_modes(&self) -> Option<&dyn SharedModes> {
        Some(self)
    }
}

/// Shared and counted holders: a sorted set at the lock key (the acquire, extend and
/// release scripts in their shared mode).
impl<R: Route> SharedModes for Redis<R> {
    fn acquire_shared(&self, request: &SharedRequest<'_>) -> NodeFuture<AcquireReply> {
        self.acquisition(&Acquisition {
            keys: std::slice::from_ref(request.keys),
            owner: request.owner,
            ttl: request.ttl,
            shared: Some(request.mode),
            fencing: request.fencing,
            fence_floor: request.fence_floor,
            fence_ttl: request.fence_ttl,
            seed_only_when_missing: false,
            waiter: None,
        })
    }

    fn extend_shared(&self, keys: &ResourceKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        self.call_map(ExtendCall::new([(keys, owner)], ttl, true), all_extended)
    }

    fn release_shared(&self, keys: &ResourceKeys, owner: &Owner) -> NodeFuture<bool> {
        self.release_hold(std::slice::from_ref(keys), owner, Hand::Next, true)
    }
}

/// One script per call for the whole set; not a Cluster's (see [`Node::sets`]).
impl<R: Route> LockSets for Redis<R> {
    fn acquire_set(&self, request: &AcquireSetRequest<'_>) -> NodeFuture<AcquireSetReply> {
        self.acquisition(&Acquisition {
            keys: request.keys,
            owner: request.owner,
            ttl: request.ttl,
            shared: None,
            fencing: request.fencing,
            fence_floor: request.fence_floor,
            fence_ttl: request.fence_ttl,
            seed_only_when_missing: request.seed_only_when_missing,
            waiter: None,
        })
    }

    fn extend_set(&self, keys: &[ResourceKeys], owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        let op = ExtendCall::new(keys.iter().map(|keys| (keys, owner)), ttl, false);
        self.call_map(op, all_extended)
    }

    fn release_set(&self, keys: &[ResourceKeys], owner: &Owner) -> NodeFuture<bool> {
        self.release_hold(keys, owner, Hand::Next, false)
    }

    fn raise_fences(
        &self,
        keys: &[ResourceKeys],
        tokens: &[u64],
        fence_ttl: Duration,
    ) -> NodeFuture<()> {
        self.call(RaiseFences::new(keys, tokens, fence_ttl))
    }
}

/// The wait queue lives in the lock scripts (`acquire_queued.lua`, `hand_off.lua`);
/// these are the release script's other entries (`call/release.rs`) and the
/// listener's mark.
impl<R: Route> WaitQueue for Redis<R> {
    fn release_as_waiter(
        &self,
        keys: &ResourceKeys,
        owner: &Owner,
        waiter: &Waiter,
    ) -> NodeFuture<bool> {
        self.release_hold(
            std::slice::from_ref(keys),
            owner,
            Hand::Leaving(waiter),
            false,
        )
    }

    fn hand_back(&self, keys: &ResourceKeys, owner: &Owner, waiter: &Waiter) -> NodeFuture<bool> {
        self.release_hold(std::slice::from_ref(keys), owner, Hand::Back(waiter), false)
    }

    fn leave_queue(&self, keys: &ResourceKeys, waiter: &Waiter) -> NodeFuture<()> {
        let leave = self.call(ReleaseCall::leave(keys, waiter, R::SHARDED));
        Box::pin(async move { leave.await.map(|_| ()) })
    }

    fn listen_for_release(&self, keys: &ResourceKeys, ttl: Duration) -> NodeFuture<()> {
        self.call(ListenCall::new(keys, ttl))
    }
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
                AcquireReply, AcquireRequest, ExtendEntry, LockSets, Node, NodeFuture, Owner,
                RecordStore, ReleaseSignal, ResourceKeys, ServerSetup, SharedModes, WaitQueue,
            };

            impl Node for $node {
                fn name(&self) -> &str {
                    self.node.name()
                }
                fn acquire(&self, request: &AcquireRequest<'_>) -> NodeFuture<AcquireReply> {
                    self.node.acquire(request)
                }
                fn extend(
                    &self,
                    keys: &ResourceKeys,
                    owner: &Owner,
                    ttl: Duration,
                ) -> NodeFuture<bool> {
                    self.node.extend(keys, owner, ttl)
                }
                fn extend_many(
                    &self,
                    entries: &[ExtendEntry<'_>],
                    ttl: Duration,
                ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
                    self.node.extend_many(entries, ttl)
                }
                fn release(&self, keys: &ResourceKeys, owner: &Owner) -> NodeFuture<bool> {
                    self.node.release(keys, owner)
                }
                fn raise_fence(
                    &self,
                    keys: &ResourceKeys,
                    token: u64,
                    ttl: Duration,
                ) -> NodeFuture<()> {
                    self.node.raise_fence(keys, token, ttl)
                }
                fn subscribe(&self, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
                    self.node.subscribe(keys)
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
                fn sets(&self) -> Option<&dyn LockSets> {
                    self.node.sets()
                }
                fn wait_queue(&self) -> Option<&dyn WaitQueue> {
                    self.node.wait_queue()
                }
                fn records(&self) -> Option<&dyn RecordStore> {
                    self.node.records()
                }
                fn shared_modes(&self) -> Option<&dyn SharedModes> {
                    self.node.shared_modes()
                }
            }
        };
    };
}

pub(crate) use forward_node;
