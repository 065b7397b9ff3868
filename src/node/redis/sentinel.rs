//! [`SentinelNode`]: a Sentinel-managed master as one lock node.

use std::fmt;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::future::FutureExt;
use redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use redis::IntoConnectionInfo;
use tokio::sync::Mutex as AsyncMutex;
use tokio::time::error::Elapsed;

use crate::error::{ConfigError, NodeError};
use crate::node::identity;
use crate::node::redis::attempt::{in_turn, Attempts};
use crate::node::redis::call::{self, Op, ReplicaWait};
use crate::node::redis::node::{redis_node, Redis, Route};
use crate::node::redis::pubsub::Hub;
use crate::node::redis::seeds;
use crate::node::redis::standalone::RedisNode;
use crate::node::{Node, NodeFuture, ReleaseSignal, ResourceKeys, ServerSetup};

/// How long one lookup through the sentinels may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(3);
/// Least time between two lookups: a master that keeps failing is not looked up in a loop.
const MIN_RESOLVE_INTERVAL: Duration = Duration::from_millis(100);
/// Default period of the background check of the sentinels' current master.
const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// A master managed by Redis Sentinel as **one** lock node, found through the sentinels
/// and followed across failovers.
///
/// The master's address comes from the sentinels (`SENTINEL MASTERS`, then `ROLE` on
/// the address to check that it really is a master; redis-rs's
/// [`sentinel`](redis::sentinel) module). It is looked up again
///
/// * when a command fails to connect or the server answers `READONLY` (it was
///   demoted to a replica) or `MASTERDOWN`; a command refused that way certainly did
///   not run, so it is sent once more to the new master within the same call;
/// * when fewer replicas than required acknowledged a write (see
///   [`wait_for_replicas`](SentinelNode::wait_for_replicas)): the master may have lost
///   its replicas in a failover;
/// * every [`check_interval`](SentinelNode::check_interval) (default 1 s) in the
///   background, which catches a failover whose old master is still reachable and not
///   yet demoted.
///
/// Commands and release notifications (`PUBLISH`/`SUBSCRIBE`) go to the current master
/// exactly as with a [`RedisNode`](crate::RedisNode); commands given while the master is
/// looked up wait in line and reach it in the order they were given. Waiters'
/// subscriptions move to the new master after a failover, and the waiters are woken
/// once to retry, since a release may have been published meanwhile.
///
/// # Safety trade-offs
///
/// Redis replicates **asynchronously**: a lock (or fence counter, or outcome record)
/// written shortly before a failover may be missing on the promoted replica, and until
/// the old master is demoted, clients on either side can both be granted the lock; the
/// background check shortens that window but cannot close it. Sentinel buys
/// availability, not safety: use several independent nodes,
/// [`wait_for_replicas`](SentinelNode::wait_for_replicas) and fencing tokens (see the
/// [stores guide](crate::guide::stores), and the [replay guide](crate::guide::replay)
/// for records).
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tower_redlock::{LockOptions, Redlock, SentinelNode};
///
/// let node = SentinelNode::open(["redis://10.0.0.1:26379", "redis://10.0.0.2:26379"], "locks")?
///     .wait_for_replicas(1, Duration::from_millis(20));
/// let locker = Redlock::new([node], LockOptions::default().node_timeout(Duration::from_millis(50)))?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct SentinelNode {
    node: Redis<Sentinels>,
}

/// The master the sentinels name, looked up again when it may have moved.
pub(crate) struct Sentinels {
    name: Arc<str>,
    address: String,
    service: String,
    sentinel: AsyncMutex<Sentinel>,
    master_info: SentinelNodeConnectionInfo,
    /// The lookups of the master, and the callers that wait for one.
    master: Attempts<Master, NodeError>,
    /// Period of the background check in ms; 0 turns it off.
    check_interval_ms: AtomicU64,
    /// Release notifications, from the current master.
    hub: Hub,
}

/// The master found by one lookup.
#[derive(Clone)]
struct Master {
    addr: String,
    node: RedisNode,
}

impl SentinelNode {
    /// A node for the master named `master_name`, found through the sentinels at
    /// `sentinels` (URLs such as `redis://host:26379`; credentials in a URL authenticate
    /// to that sentinel). The master is reached without credentials, database 0.
    ///
    /// Fails on a malformed URL or outside a Tokio runtime; looks the master up in the
    /// background and does not wait for it.
    pub fn open<T: IntoConnectionInfo>(
        sentinels: impl IntoIterator<Item = T>,
        master_name: &str,
    ) -> Result<Self, ConfigError> {
        Self::with_master_info(
            sentinels,
            master_name,
            SentinelNodeConnectionInfo::default(),
        )
    }

    /// Like [`open`](SentinelNode::open), with how to reach the master: database,
    /// username and password, TLS mode (redis-rs's [`SentinelNodeConnectionInfo`]).
    pub fn with_master_info<T: IntoConnectionInfo>(
        sentinels: impl IntoIterator<Item = T>,
        master_name: &str,
        master: SentinelNodeConnectionInfo,
    ) -> Result<Self, ConfigError> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| ConfigError::new("SentinelNode must be created inside a Tokio runtime"))?;
        if master_name.is_empty() {
            return Err(ConfigError::new("a Sentinel node needs the master's name"));
        }
        let (sentinels, name) = seeds(sentinels, "sentinel", "Sentinel")?;
        let name: Arc<str> = format!("{name}/{master_name}").into();
        let address = format!(
            "{}/{master_name}",
            identity::seeds_address("sentinel", &sentinels)
        );
        let sentinel =
            Sentinel::build(sentinels).map_err(|e| ConfigError::new(format!("{name}: {e}")))?;
        let route = Arc::new_cyclic(|route: &Weak<Sentinels>| {
            let masters = route.clone();
            let hub = Hub::found(
                name.clone(),
                Box::new(move || {
                    let route = masters.clone();
                    async move {
                        let master = dropped(route.upgrade())?.master.get().await.value?;
                        Ok::<_, NodeError>(master.node.node.route.client.clone())
                    }
                    .boxed()
                }),
            );
            let route = route.clone();
            // A lookup runs in a task of its own (`attempt.rs`) and keeps the previous
            // master's connection when its address did not change.
            let lookup = Box::new(move |previous: Option<Master>| {
                let route = route.clone();
                async move { dropped(route.upgrade())?.find_master(previous).await }.boxed()
            });
            Sentinels {
                name,
                address,
                service: master_name.to_owned(),
                sentinel: AsyncMutex::new(sentinel),
                master_info: master,
                master: Attempts::new(runtime.clone(), MIN_RESOLVE_INTERVAL, lookup),
                check_interval_ms: AtomicU64::new(millis(DEFAULT_CHECK_INTERVAL)),
                hub,
            }
        });
        // The first lookup starts at once, in the background.
        route.master.start_now();
        runtime.spawn(check_task(Arc::downgrade(&route)));
        Ok(SentinelNode {
            node: Redis { route, wait: None },
        })
    }

    /// Counts this node's vote only once `replicas` replicas acknowledged the write,
    /// within `timeout` (`WAIT replicas timeout`, pipelined behind the acquire, extend
    /// and raise-fence commands on the same connection); `replicas = 0` turns it off.
    /// See [`RedisNode::wait_for_replicas`](crate::RedisNode::wait_for_replicas) for
    /// what it buys and what it costs. A write acknowledged by too few replicas also
    /// makes the node look the master up again. Applies to this handle and its later
    /// clones.
    #[must_use]
    pub fn wait_for_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.node.wait = (replicas > 0).then_some(ReplicaWait { replicas, timeout });
        self
    }

    /// How often the sentinels are asked in the background whether the master changed
    /// (default 1 s, at least 10 ms; `None` turns the check off, leaving only the
    /// lookups on errors).
    /// Each check asks the sentinels (`SENTINEL MASTERS`) and opens one short
    /// connection to the master named (`ROLE`). Shared by every clone of this node.
    #[must_use]
    pub fn check_interval(self, interval: Option<Duration>) -> Self {
        let ms = interval.map_or(0, |i| millis(i).max(10));
        self.node
            .route
            .check_interval_ms
            .store(ms, Ordering::Relaxed);
        self
    }

    /// The address (`host:port`) of the master currently used, once it was found.
    pub fn current_master(&self) -> Option<String> {
        let (_, master) = self.node.route.master.outcome();
        master?.ok().map(|master| master.addr)
    }
}

fn dropped(route: Option<Arc<Sentinels>>) -> Result<Arc<Sentinels>, NodeError> {
    route.ok_or_else(|| NodeError::Connection("the node was dropped".into()))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
impl Sentinels {
    /// Asks the sentinels for the master (checked with `ROLE`) and connects to it,
    /// keeping the previous connection when the address did not change.
    async fn find_master(&self, previous: Option<Master>) -> Result<Master, NodeError> {
        let why = match self.ask_sentinels().await {
            Ok(Ok(client)) => return self.follow(client, previous),
            Ok(Err(e)) => {
                let e = call::node_error(e);
                tracing::warn!(node = %self.name, error = %e, "no master found through the sentinels");
                format!(": {}", call::detail(&e))
            }
            Err(_) => format!(" took over {RESOLVE_TIMEOUT:?}"),
        };
        let service = &self.service;
        let why = format!("finding master `{service}` through the sentinels{why}");
        Err(NodeError::Connection(why.into()))
    }

    /// The master at `client`'s address: `previous` when it is there, else a new node.
    fn follow(&self, client: redis::Client, previous: Option<Master>) -> Result<Master, NodeError> {
        let addr = client.get_connection_info().addr().to_string();
        if let Some(previous) = previous.filter(|p| p.addr == addr) {
            return Ok(previous);
        }
        let node = RedisNode::from_client(client)
            .map_err(|e| NodeError::Connection(e.to_string().into()))?;
        tracing::info!(node = %self.name, master = %addr, "following master");
        // The waiters' subscriptions move to it, and they retry: a release may have been
        // published there already.
        self.hub.reset();
        Ok(Master { addr, node })
    }

    /// The master the sentinels name (not checked yet), within [`RESOLVE_TIMEOUT`].
    async fn ask_sentinels(&self) -> Result<redis::RedisResult<redis::Client>, Elapsed> {
        tokio::time::timeout(RESOLVE_TIMEOUT, async {
            let mut sentinel = self.sentinel.lock().await;
            let info = Some(&self.master_info);
            sentinel.async_master_for(&self.service, info).await
        })
        .await
    }
}

/// Asks the sentinels every `check_interval` whether the master changed.
async fn check_task(inner: Weak<Sentinels>) {
    loop {
        let interval = match inner.upgrade() {
            Some(inner) => inner.check_interval_ms.load(Ordering::Relaxed),
            None => return,
        };
        // Turned off: looks again a second later whether it is back on.
        let interval = match interval {
            0 => DEFAULT_CHECK_INTERVAL,
            ms => Duration::from_millis(ms),
        };
        tokio::time::sleep(interval).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        if inner.check_interval_ms.load(Ordering::Relaxed) == 0 {
            continue;
        }
        let (generation, current) = inner.master.outcome();
        match current {
            // A lookup is in progress.
            None => {}
            // The last lookup failed and no command asked again since: retry.
            Some(Err(_)) => inner.master.renew(generation),
            Some(Ok(master)) => {
                if let Ok(Ok(client)) = inner.ask_sentinels().await
                    && client.get_connection_info().addr().to_string() != master.addr
                {
                    inner.master.renew(generation);
                }
            }
        }
    }
}

impl Route for Sentinels {
    const SHARDED: bool = false;

    fn names(&self) -> (&str, &str) {
        (&self.name, &self.address)
    }

    /// On the current master, after the callers that waited for its lookup before it
    /// (`attempt.rs`). Errors that hint at a failover start a new lookup, and an op
    /// refused without effect is sent once more to the master found.
    async fn run<O: Op>(&self, op: &O, wait: Option<ReplicaWait>) -> Result<O::Output, NodeError> {
        let mut retried = false;
        loop {
            let got = self.master.get().await;
            let master = match got.value {
                Ok(master) => master,
                Err(e) => {
                    self.master.renew(got.generation);
                    return Err(e);
                }
            };
            let mut conn = master.node.node.route.conn.clone();
            match in_turn(got.place, pin!(op.run(&mut conn, wait))).await {
                Ok(value) => return Ok(value),
                Err(e) => {
                    if e.master_may_have_moved() {
                        tracing::debug!(node = %self.name, master = %master.addr, error = ?e, "master may have moved");
                        self.master.renew(got.generation);
                        if e.certainly_not_run() && !retried {
                            retried = true;
                            continue;
                        }
                    }
                    return Err(e.into_node_error());
                }
            }
        }
    }

    /// On the current master (see `pubsub.rs`), once there is one.
    fn subscribe(self: &Arc<Self>, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
        let route = self.clone();
        let channel = keys.channel.clone();
        Box::pin(async move {
            route.master.get().await.value?;
            route.hub.subscribe(channel).await
        })
    }

    /// The current master's `run_id`.
    fn server_ids(self: Arc<Self>) -> NodeFuture<Vec<String>> {
        Box::pin(async move {
            let master = self.master.get().await.value?;
            master.node.server_ids().await
        })
    }

    /// The setup of the current master (the sentinels resolve it, as for every call).
    fn server_setup(self: Arc<Self>, probe: ResourceKeys) -> NodeFuture<Vec<ServerSetup>> {
        Box::pin(async move {
            let master = self.master.get().await.value?;
            master.node.server_setup(&probe).await
        })
    }
}

redis_node!(SentinelNode, Sentinels);

impl fmt::Debug for SentinelNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelNode")
            .field("name", &self.node.route.name)
            .field("master", &self.current_master())
            .field("wait_for_replicas", &self.node.wait)
            .finish()
    }
}
