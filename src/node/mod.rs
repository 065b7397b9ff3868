//! What implementing a [`Node`] takes: the trait, the requests the engine sends and the
//! replies it expects. Applications never need this module; a lock store of your own
//! (another database, a test double with injected failures) does.
//!
//! This is level 1 of the crate: the stores. It imports only `crate::error` (the errors); the
//! engine ([`Redlock`](crate::Redlock)) builds on it, never the other way round.
//!
//! # Implementing a node kind
//!
//! A new store goes in its own file or folder here (`node/<kind>.rs`, or
//! `node/<kind>/mod.rs` when it has several parts, as `node/redis/` does) and
//! implements [`Node`], once: a lock shape is data, not a method. A call names the keys
//! of one resource or of a set (one resource is a set of one) and a [`LockMode`];
//! every call is atomic on the node. The contract:
//!
//! - [`acquire`](Node::acquire): a set is all or nothing on the node. Each granted
//!   key's lock key holds the owner with the ttl, and its fence counter becomes
//!   `max(counter + 1, fence_floor)` (`fence_floor` when missing), lives `fence_ttl`,
//!   and is answered in [`Vote::Granted`]; a held key answers [`Vote::Held`] with
//!   its index and remaining ttl. Shared and counted holders: see [`LockMode`].
//! - [`extend`](Node::extend): compare-and-extend, never re-creating a key;
//!   [`release`](Node::release): compare-and-delete, then wake as [`Release`] says;
//!   [`raise_fences`](Node::raise_fences): raise each counter to its token if lower.
//! - The wait queue (if [`Capabilities::wait_queue`]): see [`Waiter`].
//! - [`records`](Node::records): outcome records, if the node stores them.
//!
//! The [`MemoryNode`] is the reference for what each operation must do; the Redis
//! scripts (`node/redis/scripts/`) are the same semantics in Lua. With the feature
//! `test-util`, `node::conformance` checks a node kind against this contract.

#[cfg(feature = "etcd")]
pub(crate) mod etcd;
pub(crate) mod identity;
pub(crate) mod memory;
#[cfg(any(feature = "redis", feature = "etcd", feature = "postgres"))]
pub(crate) mod percent;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
pub(crate) mod redis;
pub(crate) mod resource;
pub(crate) mod token;
pub(crate) mod url;

mod calls;
#[cfg(feature = "test-util")]
pub mod conformance;
pub(crate) mod mode;
mod owner;
mod records;
mod setup;
mod wait_queue;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

pub use calls::{Acquire, Capabilities, Hold, PerKey, Release, Vote};
pub(crate) use memory::MemoryNode;
// Public at the crate's root, its one path.
pub(crate) use mode::LockMode;
pub use owner::{Owner, ReleaseSignal};
pub(crate) use records::unsupported;
pub use records::{ClaimReply, ClaimRequest, Record, RecordStore, StoreReply, StoreRequest};
pub(crate) use resource::Resource;
pub use resource::ResourceKeys;
#[cfg(feature = "redis")]
pub(crate) use resource::{CHANNEL_SUFFIX, QUEUE_SUFFIX};
#[cfg(feature = "redis")]
pub(crate) use setup::parse_info;
pub use setup::ServerSetup;
pub(crate) use token::FencingToken;
pub use wait_queue::{Waiter, HANDOFF_TTL};

use crate::error::ConfigError;
pub(crate) use crate::error::NodeError;

/// The boxed future every node operation returns. It owns what it needs (`'static`),
/// so the locker can finish it in the background after the quorum is decided.
pub type NodeFuture<T> = Pin<Box<dyn Future<Output = Result<T, NodeError>> + Send + 'static>>;

/// The fence counters' lifetime unless [`LockOptions::fence_ttl`](crate::LockOptions::fence_ttl)
/// says otherwise; the Redis nodes' fence script knows it, so a call need not send it.
pub(crate) const DEFAULT_FENCE_TTL: Duration = Duration::from_secs(3600);

fn done() -> NodeFuture<()> {
    Box::pin(std::future::ready(Ok(())))
}

/// One lock store that casts one vote in the quorum: a Redis server
/// ([`RedisNode`](crate::RedisNode)) or the in-process [`MemoryNode`]. The module
/// docs say the contract; every operation is atomic on the node. The locker bounds
/// each call with the per-node timeout, so an implementation need not.
pub trait Node: Send + Sync + 'static {
    /// A name for logs and errors, without secrets (for example the URL without password).
    fn name(&self) -> &str;

    /// Where this node's servers are, in a canonical form (lower-case host, explicit
    /// port, no credentials, no database; seeds sorted), so that a locker refuses a
    /// node listed twice when it is built: two nodes with the same address are one
    /// server, which must not vote twice. `None` (the default) when the node has no
    /// address to compare, as a [`MemoryNode`].
    fn address(&self) -> Option<&str> {
        None
    }

    /// Checks, when a locker is built, that this node can serve a locker whose leases
    /// last `ttl`, with `nodes` nodes in all (for example a ttl the store cannot
    /// express). The default accepts every locker.
    fn check_locker(&self, ttl: Duration, nodes: usize) -> Result<(), ConfigError> {
        let _ = (ttl, nodes);
        Ok(())
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

    /// What the node can do besides the calls every node answers (a wait queue, shared
    /// modes), read once when the locker is built. The default: nothing.
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    /// Takes every key of `request` for its owner, or nothing (see [`Acquire`]): the
    /// fence rule is in the module docs, the shared modes' on [`LockMode`], the wait
    /// queue's on [`Waiter`].
    fn acquire(&self, request: &Acquire<'_>) -> NodeFuture<Vote>;

    /// Moves each hold's expiry to `now + ttl` if it is still the owner's (every key of
    /// a set; a shared holder's own entry), never re-creating it; answers per hold in
    /// the order given: `Ok(true)` extended, `Ok(false)` not ours (any more), `Err` that
    /// hold's call failed. An `Err` of the whole future means no hold is known to be
    /// extended. The locker renews every lease due at once with one call per node; a
    /// lease's own extend is a batch of one.
    fn extend(&self, holds: &[Hold<'_>], ttl: Duration)
        -> NodeFuture<Vec<Result<bool, NodeError>>>;

    /// Deletes the hold's keys (a shared holder: its entry) where they still hold its
    /// owner, and wakes as `how` says. `true` only if every key was the owner's.
    fn release(&self, hold: &Hold<'_>, how: Release<'_>) -> NodeFuture<bool>;

    /// Raises each fence counter to its token (`tokens[i]` for `keys[i]`) if it is
    /// lower, with ttl `fence_ttl`.
    fn raise_fences(
        &self,
        keys: &[ResourceKeys],
        tokens: &[u64],
        fence_ttl: Duration,
    ) -> NodeFuture<()>;

    /// Subscribes to the release notifications of one resource. The subscription is
    /// active when the future resolves; it ends when the last clone of the returned
    /// [`ReleaseSignal`] is dropped. A node that keeps the wait queue is called with
    /// `keys.channel` set to the waiter's own channel, [`Waiter::channel`]`(keys)`, and
    /// wakes only that waiter there.
    fn subscribe(&self, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal>;

    /// Takes `waiter` out of the resource's wait queue, and hands a lock reserved for
    /// it to the next waiter; the locker calls it when a waiter that may be queued
    /// gives up (timeout, error, cancellation). Nothing to do without a queue (the
    /// default).
    fn leave_queue(&self, keys: &ResourceKeys, waiter: &Waiter) -> NodeFuture<()> {
        let _ = (keys, waiter);
        done()
    }

    /// Registers, for `ttl`, a waiter that listens on the resource's own channel
    /// (`keys.channel`: a waiter for a set, or a shared holder) rather than in the wait
    /// queue, so that the resource's next release wakes it there; called before each
    /// attempt of such a waiter once it is subscribed (a release may use the mark up).
    /// A node with a queue may wake nobody on the resource's channel otherwise, so that
    /// releasing a resource nobody waits for stays cheap. Nothing to do for a node whose
    /// releases always wake the channel (the default).
    fn listen_for_release(&self, keys: &ResourceKeys, ttl: Duration) -> NodeFuture<()> {
        let _ = (keys, ttl);
        done()
    }

    /// The node's outcome records (idempotent replay), if it stores them: every node
    /// kind of the crate does; the default is `None`. A
    /// [`LockLayer`](crate::http::LockLayer) with
    /// [`replay`](crate::http::LockLayer::replay) refuses, when it is built, a locker
    /// with a node that answers `None` here, rather than failing each request.
    fn records(&self) -> Option<&dyn RecordStore> {
        None
    }
}

impl std::fmt::Debug for dyn Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Node({})", self.name())
    }
}
