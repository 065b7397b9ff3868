//! The one `Node` implementation of the three Redis kinds. They run the same operations
//! (`call/`, `records.rs`) and differ only in how a call reaches a server: a [`Route`]
//! (`standalone.rs`: one server's connection; `sentinel.rs`: the master the sentinels
//! name; `cluster.rs`: redis-rs's cluster connection, which routes by slot).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;

use crate::error::NodeError;
use crate::node::redis::call::{self, ExtendCall, Hand, Op, ReplicaWait};
use crate::node::{
    Acquire, Hold, NodeFuture, Owner, ReleaseSignal, ResourceKeys, ServerSetup, Vote,
};

/// How a Redis node's calls reach a server.
pub(crate) trait Route: Send + Sync + 'static {
    /// A call's keys may live on different servers (Cluster): a release publishes with
    /// `SPUBLISH`, and the set calls and batched extends go key by key, since one script
    /// cannot reach keys of several slots.
    const SHARDED: bool;

    /// The node's name and address.
    fn names(&self) -> (&str, &str);

    /// Runs `op` on a connection to the server that owns its keys.
    fn run<'a, O: Op>(
        &'a self,
        op: &'a O,
        wait: Option<ReplicaWait>,
    ) -> impl Future<Output = Result<O::Output, NodeError>> + Send + 'a;

    fn subscribe(self: &Arc<Self>, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal>;

    fn server_ids(self: Arc<Self>) -> NodeFuture<Vec<String>>;

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
    pub(super) fn call<O: Op>(&self, op: O) -> NodeFuture<O::Output> {
        let (route, wait) = (self.route.clone(), self.wait);
        Box::pin(async move { route.run(&op, wait).await })
    }

    /// One hold's extend: one script for its keys (key by key on a Cluster).
    pub(super) fn extend_one(&self, hold: &Hold<'_>, ttl: Duration) -> NodeFuture<bool> {
        let shared = !hold.mode.is_exclusive();
        let each = hold.keys.iter().map(|keys| (keys, hold.owner));
        if R::SHARDED && hold.keys.len() > 1 {
            let calls: Vec<_> = each
                .map(|hold| self.call_map(ExtendCall::new([hold], ttl, shared), every))
                .collect();
            return Box::pin(async move { every(join_all(calls).await) });
        }
        self.call_map(ExtendCall::new(each, ttl, shared), every)
    }

    /// One release script over `keys`, with what it does for a waiter.
    pub(super) fn release_keys(
        &self,
        keys: &[ResourceKeys],
        owner: &Owner,
        hand: Hand<'_>,
        shared: bool,
    ) -> NodeFuture<bool> {
        self.call(call::release(
            keys,
            owner.as_str(),
            hand,
            shared,
            R::SHARDED,
        ))
    }

    /// One operation, its answer mapped by `f` (no second box).
    pub(super) fn call_map<O: Op, T: Send + 'static>(
        &self,
        op: O,
        f: fn(O::Output) -> Result<T, NodeError>,
    ) -> NodeFuture<T> {
        let (route, wait) = (self.route.clone(), self.wait);
        Box::pin(async move { route.run(&op, wait).await.and_then(f) })
    }
}

/// `true` only if every answer is; a `false` wins over a failure (that key is not
/// ours, whatever the others say), a failure over `true`.
pub(super) fn every(
    answers: impl IntoIterator<Item = Result<bool, NodeError>>,
) -> Result<bool, NodeError> {
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

pub(super) fn silent(keys: &ResourceKeys) -> ResourceKeys {
    ResourceKeys {
        channel: String::new(),
        ..keys.clone()
    }
}

pub(super) fn unsupported_set<T: Send + 'static>() -> NodeFuture<T> {
    Box::pin(std::future::ready(Err(NodeError::Unsupported(
        "a set of resources in a shared mode".into(),
    ))))
}

/// A Cluster's set: the members one after the other in the request's order (each its
/// own slot); at the first one held, the members taken are released without waking
/// anyone (nothing was granted to a caller) and the answer is held. A failure releases
/// them too and answers the failure.
pub(super) fn acquire_each<R: Route>(
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
                other => other,
            };
            let undo: Vec<_> = keys[..index]
                .iter()
                .map(|keys| {
                    node.release_keys(std::slice::from_ref(keys), &owner, Hand::Next, false)
                })
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

/// `Node` and `RecordStore` for a public node type that holds a [`Redis`] over `$route`
/// as `node`.
macro_rules! redis_node {
    ($node:ty, $route:ty) => {
        const _: () = {
            use std::time::Duration;

            use futures_util::future::join_all;

            use $crate::error::NodeError;
            use $crate::node::redis::call::{self, Acquire as AcquireCall, ExtendCall, Hand};
            use $crate::node::redis::node::{acquire_each, every, silent, unsupported_set, Route};
            use $crate::node::redis::records::{self, ReadCall};
            use $crate::node::{
                Acquire, Capabilities, ClaimReply, ClaimRequest, Hold, Node, NodeFuture, Record,
                RecordStore, Release, ReleaseSignal, ResourceKeys, ServerSetup, StoreReply,
                StoreRequest, Vote, Waiter,
            };

            const SHARDED: bool = <$route as Route>::SHARDED;

            /// The node calls, mapped onto the operations of `call/`: one acquire, extend,
            /// release and raise-fences script each, over the keys of one resource or a set
            /// and a mode (key by key on a Cluster, where a set's members live in different
            /// slots).
            impl Node for $node {
                fn name(&self) -> &str {
                    self.node.route.names().0
                }

                fn address(&self) -> Option<&str> {
                    Some(self.node.route.names().1)
                }

                fn server_ids(&self) -> NodeFuture<Vec<String>> {
                    self.node.route.clone().server_ids()
                }

                fn server_setup(&self, probe: &ResourceKeys) -> NodeFuture<Vec<ServerSetup>> {
                    self.node.route.clone().server_setup(probe.clone())
                }

                fn capabilities(&self) -> Capabilities {
                    Capabilities::ALL
                }

                fn acquire(&self, request: &Acquire<'_>) -> NodeFuture<Vote> {
                    match request.keys {
                        [_] => self.node.call(AcquireCall::new(request, SHARDED)),
                        _ if !request.mode.is_exclusive() => unsupported_set(),
                        // A Cluster cannot run one script over keys of several slots.
                        keys if SHARDED => {
                            let calls: Vec<_> = keys
                                .iter()
                                .map(|keys| {
                                    let one = Acquire {
                                        keys: std::slice::from_ref(keys),
                                        ..*request
                                    };
                                    self.node.call(AcquireCall::new(&one, true))
                                })
                                .collect();
                            acquire_each(self.node.clone(), request, calls)
                        }
                        _ => self.node.call(AcquireCall::new(request, false)),
                    }
                }

                fn extend(
                    &self,
                    holds: &[Hold<'_>],
                    ttl: Duration,
                ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
                    if let [hold] = holds {
                        // A lease's own extend: the one script for its shape.
                        let call = self.node.extend_one(hold, ttl);
                        return Box::pin(async move { Ok(vec![call.await]) });
                    }
                    if SHARDED {
                        // Hold by hold, key by key: one script cannot reach several slots.
                        let calls: Vec<_> = holds
                            .iter()
                            .map(|hold| self.node.extend_one(hold, ttl))
                            .collect();
                        return Box::pin(async move { Ok(join_all(calls).await) });
                    }
                    // A renewal batch: the exclusive keys in one script, the shared holders
                    // beside it, then one answer per hold.
                    let exclusive: Vec<_> = holds
                        .iter()
                        .filter(|hold| hold.mode.is_exclusive())
                        .flat_map(|hold| hold.keys.iter().map(|keys| (keys, hold.owner)))
                        .collect();
                    let exclusive: NodeFuture<Vec<Result<bool, NodeError>>> =
                        match exclusive.is_empty() {
                            true => Box::pin(std::future::ready(Ok(Vec::new()))),
                            false => self.node.call(ExtendCall::new(exclusive, ttl, false)),
                        };
                    let shared: Vec<_> = holds
                        .iter()
                        .filter(|hold| !hold.mode.is_exclusive())
                        .map(|hold| self.node.extend_one(hold, ttl))
                        .collect();
                    let sizes: Vec<Option<usize>> = holds
                        .iter()
                        .map(|hold| hold.mode.is_exclusive().then_some(hold.keys.len()))
                        .collect();
                    Box::pin(async move {
                        let (exclusive, shared) =
                            futures_util::future::join(exclusive, join_all(shared)).await;
                        let (mut exclusive, mut shared) =
                            (exclusive?.into_iter(), shared.into_iter());
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
                    let hand = match how {
                        Release::Wake | Release::Quiet => Hand::Next,
                        Release::AsWaiter(waiter) => Hand::Leaving(waiter),
                        Release::HandBack(waiter) => Hand::Back(waiter),
                    };
                    let shared = !hold.mode.is_exclusive();
                    match keys {
                        [_] => self.node.release_keys(keys, hold.owner, hand, shared),
                        _ if shared => unsupported_set(),
                        keys if SHARDED => {
                            let calls: Vec<_> = keys
                                .iter()
                                .map(|keys| {
                                    self.node.release_keys(
                                        std::slice::from_ref(keys),
                                        hold.owner,
                                        hand,
                                        false,
                                    )
                                })
                                .collect();
                            Box::pin(async move { every(join_all(calls).await) })
                        }
                        keys => self.node.release_keys(keys, hold.owner, hand, false),
                    }
                }

                fn raise_fences(
                    &self,
                    keys: &[ResourceKeys],
                    tokens: &[u64],
                    fence_ttl: Duration,
                ) -> NodeFuture<()> {
                    if SHARDED && keys.len() > 1 {
                        let calls: Vec<_> = keys
                            .iter()
                            .zip(tokens)
                            .map(|(keys, token)| {
                                let keys = std::slice::from_ref(keys);
                                self.node.call(call::raise_fences(
                                    keys,
                                    std::slice::from_ref(token),
                                    fence_ttl,
                                ))
                            })
                            .collect();
                        return Box::pin(
                            async move { join_all(calls).await.into_iter().collect() },
                        );
                    }
                    self.node.call(call::raise_fences(keys, tokens, fence_ttl))
                }

                fn subscribe(&self, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
                    self.node.route.subscribe(keys)
                }

                fn leave_queue(&self, keys: &ResourceKeys, waiter: &Waiter) -> NodeFuture<()> {
                    // Taken off the queue; a lock reserved for it goes to the next waiter.
                    let keys = std::slice::from_ref(keys);
                    let leave = call::release(keys, "", Hand::Leaving(waiter), false, SHARDED);
                    let leave = self.node.call(leave);
                    Box::pin(async move { leave.await.map(|_| ()) })
                }

                fn listen_for_release(&self, keys: &ResourceKeys, ttl: Duration) -> NodeFuture<()> {
                    self.node.call(call::listen(keys, ttl))
                }

                fn records(&self) -> Option<&dyn RecordStore> {
                    Some(self)
                }
            }

            /// Outcome records (idempotent replay, `records.rs`). The record key carries the lock
            /// key's hash tag, so a cluster routes each call, `WAIT` included, to the shard that
            /// owns the lock; a Sentinel node follows the master as for the locks. Claims and
            /// stores honour `wait_for_replicas`: a record counts only once the replicas a failover
            /// may promote have it.
            impl RecordStore for $node {
                fn read_record(&self, keys: &ResourceKeys) -> NodeFuture<Option<Record>> {
                    self.node.call(ReadCall(keys.clone()))
                }

                fn claim_record(&self, request: &ClaimRequest<'_>) -> NodeFuture<ClaimReply> {
                    self.node.call(records::claim(request))
                }

                fn store_record(&self, request: &StoreRequest<'_>) -> NodeFuture<StoreReply> {
                    self.node.call(records::store(request))
                }

                fn discard_record(&self, keys: &ResourceKeys, token: u64) -> NodeFuture<bool> {
                    self.node.call(records::discard(keys, token))
                }
            }
        };
    };
}

pub(crate) use redis_node;
