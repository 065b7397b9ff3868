//! [`RedisNode`]: one Redis server as a lock node, over redis-rs.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::{Client, IntoConnectionInfo};

use crate::error::{ConfigError, NodeError};
use crate::node::identity;
use crate::node::redis::batching::Batching;
use crate::node::redis::call::{CallError, Op, ReplicaWait};
use crate::node::redis::conn::Resending;
use crate::node::redis::node::{redis_node, Redis, Route};
use crate::node::redis::pubsub::Hub;
use crate::node::redis::setup;
use crate::node::{NodeFuture, ReleaseSignal, ResourceKeys, ServerSetup};

/// One Redis server (standalone master) as a lock node.
///
/// Commands go over one multiplexed connection shared by every lease and task, made
/// again when found broken: concurrent callers' commands go out together under Tokio's
/// multi-thread runtime, and a command that finds the connection broken (the server
/// restarted while the locker was idle) is sent once more on the new one, within the
/// per-node timeout; every command is safe to run twice (see the owner checks). Scripts
/// run with `EVALSHA`, loaded again after `NOSCRIPT`. Release notifications arrive over
/// a second, RESP3 connection, opened on first use and kept by one task per node across
/// server restarts, every command bounded in time.
///
/// Create it inside a Tokio runtime. It connects lazily, so a locker starts even while
/// a minority of its nodes is down.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_redlock::{LockOptions, RedisNode, Redlock};
///
/// let nodes = [
///     RedisNode::open("redis://127.0.0.1:7001/0")?,
///     RedisNode::open("redis://127.0.0.1:7002/0")?,
///     RedisNode::open("redis://127.0.0.1:7003/0")?,
/// ];
/// let locker = Redlock::new(nodes, LockOptions::default())?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisNode {
    pub(super) node: Redis<Direct>,
}

/// One server's connection: every call goes to it.
pub(crate) struct Direct {
    name: Arc<str>,
    address: String,
    pub(super) conn: Batching,
    hub: Hub,
    /// What the connections are made from (again by [`RedisNode::tcp_nodelay`]).
    pub(super) client: Client,
}

impl RedisNode {
    /// A node for one Redis URL: `redis://[user:password@]host:port/db`, or
    /// `rediss://…` with the `tls` feature.
    ///
    /// Fails on a malformed URL or outside a Tokio runtime; does not connect yet.
    pub fn open(url: impl IntoConnectionInfo) -> Result<Self, ConfigError> {
        let client =
            Client::open(url).map_err(|e| ConfigError::new(format!("bad Redis URL: {e}")))?;
        Self::from_client(client)
    }

    /// A node over an already configured redis-rs [`Client`]. Its commands go out with
    /// `TCP_NODELAY` set, whatever the client says; see [`tcp_nodelay`](Self::tcp_nodelay).
    pub fn from_client(client: Client) -> Result<Self, ConfigError> {
        Self::connect_lazily(client, true)
    }

    /// Whether the command connection sends each command at once (`TCP_NODELAY`,
    /// `true`, the default), or lets the kernel hold a small command back while an
    /// earlier one still waits for its acknowledgement and send them together
    /// (Nagle's algorithm, `false`: redis-rs's own default, and rslock's). Returns the
    /// node with a new connection, for this handle and its later clones.
    ///
    /// Under Tokio's multi-thread runtime the node already sends concurrent commands
    /// together itself, without Nagle's wait; the trade-off and its measurements are in
    /// the operations guide and BENCHMARKS.md. The lock's safety does not depend on it.
    ///
    /// Fails outside a Tokio runtime, as [`from_client`](Self::from_client) does. The
    /// `tcp_nodelay=false` parameter of [`node_from_url`](crate::node_from_url) does the
    /// same.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_redlock::RedisNode;
    ///
    /// let node = RedisNode::open("redis://127.0.0.1:7001/0")?.tcp_nodelay(false)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn tcp_nodelay(self, nodelay: bool) -> Result<Self, ConfigError> {
        let mut node = Self::connect_lazily(self.node.route.client.clone(), nodelay)?;
        node.node.wait = self.node.wait;
        Ok(node)
    }

    fn connect_lazily(client: Client, nodelay: bool) -> Result<Self, ConfigError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(ConfigError::new(
                "RedisNode must be created inside a Tokio runtime",
            ));
        }
        let info = client.get_connection_info().clone();
        let tcp = info.tcp_settings().clone().set_nodelay(nodelay);
        let client = Client::open(info.set_tcp_settings(tcp))
            .map_err(|e| ConfigError::new(format!("bad Redis connection settings: {e}")))?;
        let info = client.get_connection_info();
        let address = identity::address(info.addr());
        let name: Arc<str> = format!("redis://{address}/{}", info.redis_settings().db()).into();
        let hub = Hub::new(name.clone(), &client)
            .map_err(|e| ConfigError::new(format!("{name}: {e}")))?;
        Ok(RedisNode {
            node: Redis::new(Direct {
                name,
                address,
                conn: Batching::new(Resending::new(client.clone())),
                hub,
                client,
            }),
        })
    }

    /// Counts this node's vote only once `replicas` replicas acknowledged the write,
    /// within `timeout`; `replicas = 0` turns it off (the default). Applies to this
    /// handle and its later clones.
    ///
    /// `WAIT replicas timeout` is pipelined behind the acquire, extend and raise-fence
    /// commands on the same connection, so it covers them (and any earlier write of the
    /// connection); when fewer replicas acknowledged in time, the node answers with an
    /// error instead of its grant, the locker counts no vote from it and releases there
    /// as after any failed attempt. Releases never wait: a lost release only delays the
    /// next holder until the key expires.
    ///
    /// What it buys: a lock granted by a replicated master survives a failover to one of
    /// the replicas that acknowledged it, with its fence counter. `WAIT` is not
    /// consensus, though: a failover may still promote a replica that did not
    /// acknowledge, and it does not close a failover's split-brain window (see
    /// [`SentinelNode`](crate::SentinelNode)). Use several independent nodes and check
    /// fencing tokens.
    ///
    /// What it costs: every grant and renewal waits for a replication round trip, and a
    /// blocked `WAIT` holds back every command queued behind it on this node's single
    /// multiplexed connection, up to `timeout` when replicas lag. Keep `timeout` well
    /// under [`LockOptions::node_timeout`](crate::LockOptions::node_timeout) (which
    /// bounds the whole call), and `replicas` at most the number of replicas the master
    /// normally has, or no vote ever counts. A replica that just (re)synced is not
    /// counted until its first acknowledgement, up to a second later, so votes may
    /// fail during that second; after a failover, until the old master rejoins as a
    /// replica, a master with a single replica has none to acknowledge.
    ///
    /// `timeout` is sent in whole milliseconds from 1 ms (Redis's `WAIT 0` would block
    /// until enough replicas acknowledged) to 30 days (`Duration::MAX` included).
    #[must_use]
    pub fn wait_for_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.node.wait = (replicas > 0).then_some(ReplicaWait { replicas, timeout });
        self
    }
}

impl Route for Direct {
    const SHARDED: bool = false;

    fn names(&self) -> (&str, &str) {
        (&self.name, &self.address)
    }

    async fn run<O: Op>(&self, op: &O, wait: Option<ReplicaWait>) -> Result<O::Output, NodeError> {
        let mut conn = self.conn.clone();
        op.run(&mut conn, wait)
            .await
            .map_err(CallError::into_node_error)
    }

    // The subscriptions are kept by one upkeep task per node (see `pubsub`): they
    // come back after the server restarts, and a frozen server piles nothing up.
    fn subscribe(self: &Arc<Self>, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
        let channel = keys.channel.clone();
        let hub = self.hub.clone();
        Box::pin(async move { hub.subscribe(channel).await })
    }

    fn server_ids(self: Arc<Self>) -> NodeFuture<Vec<String>> {
        Box::pin(async move { identity::run_id(&mut self.conn.clone()).await })
    }

    fn server_setup(self: Arc<Self>, probe: ResourceKeys) -> NodeFuture<Vec<ServerSetup>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let mut found = setup::read_info(&mut conn, &self.address).await?;
            setup::probe_permissions(&mut conn, &probe, false, &mut found).await?;
            Ok(vec![found])
        })
    }
}

redis_node!(RedisNode, Direct);

impl fmt::Debug for RedisNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RedisNode")
            .field(&self.node.route.name)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::{Acquire, Hold, LockMode, Node, Owner, Release, Resource};

    #[tokio::test]
    async fn commands_go_out_at_once_unless_told_otherwise() {
        let nodelay = |node: &RedisNode| {
            node.node
                .route
                .client
                .get_connection_info()
                .tcp_settings()
                .nodelay()
        };
        // redis-rs's own default is Nagle's algorithm: a client as it comes is overridden.
        let client = Client::open("redis://127.0.0.1:1/0").unwrap();
        assert!(!client.get_connection_info().tcp_settings().nodelay());
        let node = RedisNode::from_client(client).unwrap();
        assert!(nodelay(&node));
        let wait = Duration::from_millis(5);
        let node = node.wait_for_replicas(1, wait).tcp_nodelay(false).unwrap();
        assert!(!nodelay(&node));
        assert_eq!(
            node.node.wait.map(|w| (w.replicas, w.timeout)),
            Some((1, wait))
        );
        assert_eq!(node.name(), "redis://127.0.0.1:1/0");
        assert!(nodelay(&node.tcp_nodelay(true).unwrap()));
    }

    /// A node call's boxed future stays within the allocator's fast path (glibc's
    /// per-thread cache serves blocks up to 1,032 B): it holds a batch's place, or
    /// redis-rs's send future in a box of its own, never that future inline, and the
    /// rare paths (replicas' `WAIT`, a missing script, waiters queued) in boxes too.
    /// Inline, each was allocated and copied per call, and cost throughput
    /// (BENCHMARKS.md).
    #[tokio::test]
    async fn a_node_call_future_fits_the_allocator_fast_path() {
        let node = RedisNode::open("redis://127.0.0.1:1/0").unwrap();
        let keys = ResourceKeys::new("p:", &Resource::new("r"));
        let owner = Owner::random();
        let keys = std::slice::from_ref(&keys);
        let hold = Hold {
            keys,
            owner: &owner,
            mode: LockMode::Exclusive,
        };
        let release = node.release(&hold, Release::Wake);
        let request = Acquire {
            keys,
            owner: &owner,
            mode: LockMode::Exclusive,
            ttl: Duration::from_secs(30),
            fence_ttl: Duration::from_secs(3600),
            fencing: true,
            fence_floor: 1,
            seed_only_when_missing: false,
            waiter: None,
        };
        let acquire = node.acquire(&request);
        let (release, acquire) = (
            std::mem::size_of_val(&*release),
            std::mem::size_of_val(&*acquire),
        );
        for (call, size) in [("release", release), ("acquire", acquire)] {
            assert!(size <= 1024, "a {call}'s future is {size} B");
        }
    }
}
