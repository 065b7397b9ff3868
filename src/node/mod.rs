//! What implementing a [`Node`] takes: the trait, the requests the engine sends and the
//! replies it expects. Applications never need this module; a lock store of your own
//! (another database, a test double with injected failures) does.
//!
//! This is level 1 of the crate: the stores. It imports only `crate::error` (the errors); the
//! engine ([`Redlock`](crate::Redlock)) builds on it, never the other way round.
//!
//! | item | what it is |
//! |---|---|
//! | [`Node`] | one lock store casting one vote: acquire, extend, release, raise the fence, subscribe to releases; and the capabilities it has |
//! | [`LockSets`] | capability: one atomic call for a set of resources (without it the locker composes per-key calls) |
//! | [`WaitQueue`] | capability: a cross-process wait queue per resource, so waiters are served in order |
//! | [`NodeFuture`] | the boxed future every operation returns |
//! | [`ExtendEntry`] | one key of a batched renewal ([`Node::extend_many`]) |
//! | [`AcquireRequest`] / [`AcquireReply`] | one acquire: keys, owner, ttl, fence settings; granted with the node's fence counter, or held with the holder's ttl |
//! | [`AcquireSetRequest`] / [`AcquireSetReply`] | one acquire of a set of resources, all or nothing on the node (see [`LockSets::acquire_set`]) |
//! | [`Resource`] / [`ResourceKeys`] | a lock's name, and its keys (lock, fence counter, record, wake-up channel) |
//! | [`Owner`] | the random value that identifies one acquisition |
//! | [`Waiter`] | one process's place in a resource's cross-process wait queue |
//! | [`ReleaseSignal`] | what a subscription hands waiters: wakes them when the resource is released |
//! | [`SharedModes`] / [`SharedMode`] / [`SharedRequest`] | capability: shared (reader) and counted holders beside the exclusive lease, which [`Node::shared_modes`] hands out |
//! | [`RecordStore`] | capability: outcome records (idempotent replay); a replaying layer refuses a locker without it when built |
//! | [`Record`], [`ClaimRequest`] / [`ClaimReply`], [`StoreRequest`] / [`StoreReply`] | outcome records of idempotent replay (see [`lock::record`](crate::record)) |
//! | [`ServerSetup`] | what a node's servers report about the settings a lock relies on (role, eviction policy, permissions) |
//! | [`FencingToken`] | the number a fence counter hands out (see [`fencing`](crate::fencing)) |
//! | [`NodeError`] | how one node's operation failed |
//! | [`MemoryNode`] | the in-process implementation, a reference for the semantics |
//!
//! # Adding a node kind
//!
//! A new store goes in its own file or folder here (`node/<kind>.rs`, or
//! `node/<kind>/mod.rs` when it has several parts, as `node/redis/` does) and
//! implements [`Node`]. The [`MemoryNode`] is the reference for what each operation
//! must do atomically; the Redis scripts (`node/redis/scripts/`) are the same semantics
//! in Lua.
//!
//! [`Node`] is what every store must do. What only some can do is a capability: a trait
//! of its own that the node hands out from an accessor ([`Node::sets`],
//! [`Node::wait_queue`], [`Node::records`]), `None` by default. The locker reads them
//! once, when it is built: without sets it composes per-key calls, without a queue on a
//! majority it wakes every waiter at each release, and a replaying layer refuses a
//! locker whose nodes keep no records. No capability has methods that fail at run time.

mod dispatch;
#[cfg(feature = "etcd")]
pub(crate) mod etcd;
pub(crate) mod identity;
pub(crate) mod memory;
mod modes;
#[cfg(any(feature = "redis", feature = "etcd"))]
pub(crate) mod percent;
mod records;
#[cfg(feature = "redis")]
pub(crate) mod redis;
pub(crate) mod resource;
mod set;
mod setup;
pub(crate) mod token;
mod wait_queue;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

pub(crate) use crate::error::NodeError;
pub(crate) use dispatch::NodeCalls;
pub(crate) use memory::MemoryNode;
pub use modes::{SharedMode, SharedModes, SharedRequest};
pub(crate) use records::unsupported;
pub use records::{ClaimReply, ClaimRequest, Record, RecordStore, StoreReply, StoreRequest};
pub(crate) use resource::Resource;
pub use resource::ResourceKeys;
#[cfg(feature = "redis")]
pub(crate) use resource::{CHANNEL_SUFFIX, QUEUE_SUFFIX};
pub use set::{AcquireSetReply, AcquireSetRequest, LockSets};
#[cfg(feature = "redis")]
pub(crate) use setup::parse_info;
pub use setup::ServerSetup;
pub(crate) use token::FencingToken;
pub use wait_queue::{WaitQueue, Waiter, HANDOFF_TTL};

use crate::error::ConfigError;

/// The boxed future every node operation returns. It owns what it needs (`'static`),
/// so the locker can finish it in the background after the quorum is decided.
pub type NodeFuture<T> = Pin<Box<dyn Future<Output = Result<T, NodeError>> + Send + 'static>>;

/// One lock store that casts one vote in the quorum: a Redis server
/// ([`RedisNode`](crate::RedisNode)) or the in-process [`MemoryNode`].
///
/// Every operation is atomic on the node. The locker bounds each call with the
/// per-node timeout, so an implementation need not.
pub trait Node: Send + Sync + 'static {
    /// A name for logs and errors, without secrets (for example the URL without password).
    fn name(&self) -> &str;

    /// Checks, when a locker is built, that this node can serve a locker whose leases
    /// last `ttl`, with `nodes` nodes in all (for example a ttl the store cannot
    /// express). The default accepts every locker.
    fn check_locker(&self, ttl: Duration, nodes: usize) -> Result<(), ConfigError> {
        let _ = (ttl, nodes);
        Ok(())
    }

    /// Sets the lock key to `owner` with `ttl` unless it exists. On success sets the fence
    /// counter to `max(counter + 1, fence_floor)` (just `fence_floor` when missing),
    /// refreshes its ttl to `fence_ttl` and returns it; otherwise returns the key's
    /// remaining ttl. See [`fencing`](crate::fencing) for why the floor.
    fn acquire(&self, request: &AcquireRequest<'_>) -> NodeFuture<AcquireReply>;

    /// Sets the lock key's ttl to `ttl` if it still holds `owner`. Never creates it.
    /// Returns whether the key was extended.
    fn extend(&self, keys: &ResourceKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool>;

    /// [`extend`](Node::extend) for many keys at once, each with its own owner and all
    /// with one `ttl`, answering per entry in the order given: `Ok(true)` extended,
    /// `Ok(false)` not ours (any more), `Err` that entry's call failed; an `Err` of the
    /// whole future means no entry is known to be extended. The locker renews every
    /// lease due at once with one call per node; a node kind that can, does it in one
    /// round trip (the Redis nodes send one script per few hundred keys, pipelined).
    /// The default makes the per-key [`extend`](Node::extend) calls concurrently.
    fn extend_many(
        &self,
        entries: &[ExtendEntry<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
        let calls: Vec<_> = entries
            .iter()
            .map(|entry| self.extend(entry.keys, &entry.owner, ttl))
            .collect();
        Box::pin(async move { Ok(futures_util::future::join_all(calls).await) })
    }

    /// Deletes the lock key if it still holds `owner`, and then wakes the waiters
    /// subscribed to the resource (a node with a wait queue: see
    /// [`wait_queue`](Node::wait_queue)) — unless `keys.channel` is empty, which the
    /// locker passes when it cleans up a failed attempt. Returns whether the key was
    /// deleted.
    fn release(&self, keys: &ResourceKeys, owner: &Owner) -> NodeFuture<bool>;

    /// Raises the fence counter to `token` if it is lower.
    fn raise_fence(&self, keys: &ResourceKeys, token: u64, fence_ttl: Duration) -> NodeFuture<()>;

    /// Subscribes to the release notifications of one resource. The subscription is
    /// active when the future resolves; it ends when the last clone of the returned
    /// [`ReleaseSignal`] is dropped.
    ///
    /// A node that keeps the wait queue ([`wait_queue`](Node::wait_queue)) is called
    /// with `keys.channel` set to the waiter's own channel,
    /// [`Waiter::channel`]`(keys)`, and wakes only that waiter there.
    fn subscribe(&self, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal>;

    /// Where this node's servers are, in a canonical form (lower-case host, explicit
    /// port, no credentials, no database; seeds sorted), so that a locker refuses a
    /// node listed twice when it is built: two nodes with the same address are one
    /// server, which must not vote twice. `None` (the default) when the node has no
    /// address to compare, as a [`MemoryNode`].
    fn address(&self) -> Option<&str> {
        None
    }

    /// The identities of the servers that vote through this node: Redis's `run_id`
    /// (`INFO server`) of a standalone server or of a Sentinel-managed master, the
    /// `run_id`s of every master of a cluster. [`Redlock::connect`](crate::Redlock::connect)
    /// asks every node once and refuses two nodes that share a server, which catches
    /// one server reached under two names (`localhost` and `127.0.0.1`). Empty (the
    /// default) when the node cannot tell.
    ///
    /// Only a convenience: whatever a check at start-up misses (a node down then, a
    /// failover or DNS change later), per-node owner values (see [`Owner::for_node`])
    /// still keep one server from casting two votes.
    fn server_ids(&self) -> NodeFuture<Vec<String>> {
        Box::pin(std::future::ready(Ok(Vec::new())))
    }

    /// What this node's servers report about the settings a lock relies on, one
    /// [`ServerSetup`] per server that votes through it (a cluster's masters, a
    /// Sentinel group's current master). [`Redlock::connect`](crate::Redlock::connect)
    /// refuses a replica, an evicting memory policy and a user without the permissions
    /// the locker needs, and the locker it builds asks again periodically and logs
    /// what changed. Empty (the default) when the node cannot tell.
    ///
    /// `probe` are the keys of a resource under the locker's key prefix that no lease
    /// uses: a node may run its commands on them to learn what the connection's user
    /// is allowed (it must leave no key behind).
    fn server_setup(&self, probe: &ResourceKeys) -> NodeFuture<Vec<ServerSetup>> {
        let _ = probe;
        Box::pin(std::future::ready(Ok(Vec::new())))
    }

    /// The node's atomic set calls, if it has them: every node kind of the crate does.
    /// Without them (the default, `None`) the locker takes a set member by member
    /// with [`acquire`](Node::acquire) and undoes what it took at the first member
    /// held: all or nothing on the node all the same, in more round trips.
    fn sets(&self) -> Option<&dyn LockSets> {
        None
    }

    /// The node's cross-process wait queue, if it keeps one (the Redis nodes and the
    /// [`MemoryNode`] do). Without one (the default, `None`) each release wakes every
    /// waiter of the resource on [`ResourceKeys::channel`], and waiters
    /// are served in the order their retries land; a locker whose majority of nodes
    /// keep a queue serves them in order (see [`WaitQueue`]).
    fn wait_queue(&self) -> Option<&dyn WaitQueue> {
        None
    }

    /// The node's outcome records (idempotent replay), if it stores them: every node
    /// kind of the crate does; the default is `None`. A
    /// [`LockLayer`](crate::http::LockLayer) with
    /// [`replay`](crate::http::LockLayer::replay) refuses, when it is built, a locker
    /// with a node that answers `None` here, rather than failing each request.
    fn records(&self) -> Option<&dyn RecordStore> {
        None
    }

    /// The node's shared and counted holders (readers beside writers, `n` permits), if
    /// it keeps them: see [`SharedModes`] for what each operation must do. The default
    /// is `None`; a locker built for those modes refuses such a node.
    fn shared_modes(&self) -> Option<&dyn SharedModes> {
        None
    }
}

impl fmt::Debug for dyn Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Node({})", self.name())
    }
}

/// Arguments of [`Node::acquire`].
#[derive(Debug, Clone, Copy)]
pub struct AcquireRequest<'a> {
    /// The keys of the resource.
    pub keys: &'a ResourceKeys,
    /// The owner value of this acquisition.
    pub owner: &'a Owner,
    /// The lock key's time to live.
    pub ttl: Duration,
    /// The fence counter's time to live.
    pub fence_ttl: Duration,
    /// Maintain the fence counter; when `false` (see
    /// [`LockOptions::fencing`](crate::LockOptions::fencing)) the node sets the lock key
    /// only and answers `Acquired { fence: 0 }`.
    pub fencing: bool,
    /// The least fence value this acquisition may return: the acquiring client's clock
    /// in ms × 2¹⁰, read once per round so that every node gets the same floor (see
    /// [`fencing`](crate::fencing)); 0 when `fencing` is `false`.
    pub fence_floor: u64,
    /// Test hook: apply `fence_floor` only when the counter is missing (the unsafe rule
    /// a counter restored behind breaks). Set by
    /// `LockOptions::unsafe_fence_seed_only_when_missing`; never set it otherwise.
    #[doc(hidden)]
    pub seed_only_when_missing: bool,
    /// The waiting caller's place in the wait queue, when it waits
    /// ([`Redlock::acquire`](crate::Redlock::acquire)); `None` for
    /// [`try_acquire`](crate::Redlock::try_acquire), which never queues. Nodes without
    /// a queue ignore it (see [`Node::wait_queue`]).
    pub waiter: Option<&'a Waiter>,
}

/// The fence counters' lifetime unless [`LockOptions::fence_ttl`](crate::LockOptions::fence_ttl)
/// says otherwise; the Redis nodes' fence script knows it, so a call need not send it.
pub(crate) const DEFAULT_FENCE_TTL: Duration = Duration::from_secs(3600);

/// One entry of [`Node::extend_many`]: a resource's keys and the owner value its lock
/// key must hold on this node.
#[derive(Debug, Clone)]
pub struct ExtendEntry<'a> {
    /// The keys of the resource.
    pub keys: &'a ResourceKeys,
    /// The owner value expected in the lock key (already this node's, see
    /// [`Owner::for_node`]).
    pub owner: Owner,
}

/// One node's answer to [`Node::acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcquireReply {
    /// The key was set; the node's fence counter now reads `fence`.
    Acquired {
        /// The node's fence counter after the increment.
        fence: u64,
    },
    /// Someone else holds the key for `pttl` more (`None`: the key has no ttl).
    Held {
        /// The key's remaining time to live.
        pttl: Option<Duration>,
    },
    /// Shared holders hold the resource in another mode than the one asked
    /// ([`SharedModes::acquire_shared`] only): a counted request meeting holders with
    /// another `n`, a reader meeting permits, or permits meeting readers.
    OtherMode {
        /// The mode the live holders hold it in.
        held: SharedMode,
    },
}

/// The random value that marks one acquisition as the owner of a key: hex-encoded, 40
/// characters. A new value is drawn for every acquisition, so ownership belongs to the
/// lease, never to a task, thread or process.
///
/// Every node gets its own value, [`for_node`](Owner::for_node)`(i)`: the lease's 152
/// random bits followed by the node's index. That is what makes one server count once
/// even when it is listed twice (under two names, or reached twice after a failover or
/// a DNS change): the second `SET NX` there finds another node's value, not its own,
/// and reads as held rather than as a resent grant. Node implementations receive the
/// value for themselves and need not know about it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Owner([u8; 40]);

const HEX: &[u8; 16] = b"0123456789abcdef";

impl Owner {
    /// Most nodes a locker may have: the node index takes the last two hex digits.
    pub(crate) const MAX_NODES: usize = 256;

    pub(crate) fn random() -> Self {
        // 19 random bytes; the 20th is the node index, 0 here (see `for_node`). Filled
        // in one call: `rand::random::<[u8; 19]>()` draws each byte on its own.
        let mut bytes = [0u8; 19];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut bytes);
        let mut out = [b'0'; 40];
        for (i, b) in bytes.iter().enumerate() {
            out[2 * i] = HEX[usize::from(b >> 4)];
            out[2 * i + 1] = HEX[usize::from(b & 0x0f)];
        }
        Owner(out)
    }

    /// The value this acquisition stores on node `index` of its locker (0 is the
    /// lease's own value, [`LeaseHandle::owner`](crate::LeaseHandle::owner)). Indices
    /// wrap at 256, which a locker never reaches: it refuses more nodes.
    pub fn for_node(&self, index: usize) -> Owner {
        let mut out = self.0;
        let index = (index % Self::MAX_NODES) as u8;
        out[38] = HEX[usize::from(index >> 4)];
        out[39] = HEX[usize::from(index & 0x0f)];
        Owner(out)
    }

    /// The value as stored in the lock key.
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits are ever stored.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Owner({})", self.as_str())
    }
}

/// A live subscription to one resource's release notifications.
///
/// Every notification bumps a counter; [`changed`](ReleaseSignal::changed) resolves when
/// the counter moved past the value seen last, so a release that happened between
/// [`mark_seen`](ReleaseSignal::mark_seen) and waiting is never missed.
#[derive(Clone)]
pub struct ReleaseSignal {
    // Declared before the guard, so dropped before it: the guard of the last clone
    // finds no receiver of this signal left (see `MemoryNode`'s subscriptions).
    rx: watch::Receiver<u64>,
    _subscription: Arc<dyn Send + Sync>,
}

impl ReleaseSignal {
    /// Wraps a receiver of release counts and a guard that ends the subscription when
    /// the last clone drops (for [`Node`] implementations).
    pub fn new(rx: watch::Receiver<u64>, subscription: Arc<dyn Send + Sync>) -> Self {
        ReleaseSignal {
            rx,
            _subscription: subscription,
        }
    }

    /// Marks every notification so far as seen.
    pub fn mark_seen(&mut self) {
        self.rx.borrow_and_update();
    }

    /// Resolves at the next notification not yet seen. Pending forever if the node
    /// dropped its sender (the fallback retry then takes over).
    pub async fn changed(&mut self) {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl fmt::Debug for ReleaseSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseSignal")
            .field("releases", &*self.rx.borrow())
            .finish()
    }
}
