//! [`ClusterNode`]: one Redis Cluster as one lock node, over redis-rs's async cluster client.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt, Shared};
use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::io::tcp::TcpSettings;
use redis::{IntoConnectionInfo, Value};
use tokio::time::Instant;

use crate::error::{ConfigError, NodeError};
use crate::node::identity;
use crate::node::redis::call::ReplicaWait;
use crate::node::redis::call::{
    self, Acquire, CallError, ExtendCall, ListenCall, RaiseFenceCall, ReleaseCall,
};
use crate::node::redis::line::{in_turn, Line, Place};
use crate::node::redis::pubsub::{ClusterBuilder, Hub};
use crate::node::redis::records;
use crate::node::redis::seeds;
use crate::node::redis::setup;
use crate::node::LockKeys;
use crate::node::{parse_info, ServerSetup};
use crate::node::{AcquireReply, AcquireRequest, Node, NodeFuture, Owner, ReleaseSignal, Waiter};
use crate::node::{ClaimReply, ClaimRequest, Record, RecordStore, StoreReply, StoreRequest};
use crate::node::{SharedModes, WaitQueue};

mod modes;

type Configure = dyn Fn(ClusterClientBuilder) -> ClusterClientBuilder + Send + Sync;
type Connect = Shared<BoxFuture<'static, Result<ClusterConnection, NodeError>>>;

/// Least time between two attempts to connect to the cluster.
const RECONNECT_INTERVAL: Duration = Duration::from_millis(100);

/// One Redis Cluster as **one** lock node: the cluster casts one vote, however many
/// shards it has.
///
/// A resource's keys (`{prefix}{<resource>}`, `…:fence`) and its wake-up channel
/// (`…:released`) share one hash tag, so they live in one slot on one shard, and every
/// script runs on that shard's master. Redirections (`MOVED`, `ASK`) during resharding
/// and failover are followed by redis-rs's async cluster client, which also discovers
/// the topology from the seeds: any reachable node of the cluster is enough to start.
///
/// Release notifications use **sharded pub/sub** (Redis ≥ 7): the release script
/// `SPUBLISH`es on the resource's channel, and waiters `SSUBSCRIBE` over a second,
/// RESP3 cluster connection (opened on first use, shared by every waiter), on a node
/// of the shard that owns the channel's slot (a shard's replicas get its `SPUBLISH`es
/// too). When the slot moves (resharding, failover) the server ends the subscription,
/// and when a connection drops it is gone: in both cases the waiters are woken to
/// retry and the subscription is made again, following the slot. A notification lost
/// in between is covered by the waiters' fallback retry. One task per node keeps that
/// connection, every command bounded: a frozen master makes it reconnect rather than
/// pile up work for the waiters that gave up.
///
/// # Safety trade-offs
///
/// A cluster is one vote, so it is as safe as its shards' replication: Redis replicates
/// **asynchronously**. When a shard's master fails and its replica is promoted, a lock
/// granted (or extended, or a fence counter raised) shortly before the failure may not
/// have reached the replica: the new master does not know the lock, and a second
/// client can acquire it while the first still believes it holds it. Its fence counter
/// may also lag, so the second client's token is not guaranteed to be greater.
///
/// * For mutual exclusion that survives the failure of any one machine, prefer several
///   **independent** masters (3 or 5, each a [`RedisNode`](crate::RedisNode), or even
///   several independent clusters): Redlock needs a majority of them, and one node
///   losing a key cannot break it. A single cluster scales throughput, not safety.
/// * [`wait_for_replicas`](ClusterNode::wait_for_replicas) narrows the window (see
///   there), and fencing tokens checked by the protected storage turn a lost lock into
///   a rejected write instead of a corruption whenever the counter survived.
///
/// Outcome records (idempotent replay) share the lock key's slot and its trade-off: with
/// `wait_for_replicas` a record counts only once the shard's replicas have it and
/// survives a failover to one of them; what a failover to a replica without it loses is
/// described on [`SentinelNode`](crate::SentinelNode).
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_redlock::{ClusterNode, LockOptions, Redlock};
///
/// let cluster = ClusterNode::open(["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"])?;
/// let locker = Redlock::new([cluster], LockOptions::default())?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ClusterNode {
    inner: Arc<Inner>,
    wait: Option<ReplicaWait>,
}

struct Inner {
    name: Arc<str>,
    address: String,
    client: ClusterClient,
    runtime: tokio::runtime::Handle,
    /// The connection, once made. redis-rs keeps it working from then on (reconnects,
    /// topology refreshes); until then, failed attempts are made again on demand.
    connecting: Mutex<Connecting>,
    /// Sharded pub/sub, over a connection of its own (see `pubsub.rs`).
    hub: Hub,
    /// The callers that waited for the connection (see [`Line`]).
    line: Line,
}

struct Connecting {
    started: Instant,
    attempt: Connect,
}

impl ClusterNode {
    /// A node for the cluster reached through `seeds` (one or more node URLs:
    /// `redis://[user:password@]host:port`, or `rediss://…` with the `tls` feature).
    /// Every seed must carry the same credentials.
    ///
    /// Fails on a malformed URL or outside a Tokio runtime; connects in the background
    /// and does not wait for it.
    pub fn open<T: IntoConnectionInfo>(
        seeds: impl IntoIterator<Item = T>,
    ) -> Result<Self, ConfigError> {
        Self::with_config(seeds, |builder| builder)
    }

    /// Like [`open`](ClusterNode::open), with `configure` applied to the redis-rs
    /// [`ClusterClientBuilder`] of both connections (commands and pub/sub), for example
    /// to set TLS certificates, timeouts, or `tcp_settings` without `TCP_NODELAY` (the
    /// crate's default sets it: see [`RedisNode::tcp_nodelay`](crate::RedisNode::tcp_nodelay)).
    /// The subscriber's builder is then switched to RESP3 with a push sender.
    pub fn with_config<T: IntoConnectionInfo>(
        seeds: impl IntoIterator<Item = T>,
        configure: impl Fn(ClusterClientBuilder) -> ClusterClientBuilder + Send + Sync + 'static,
    ) -> Result<Self, ConfigError> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| ConfigError::new("ClusterNode must be created inside a Tokio runtime"))?;
        let (seeds, name) = seeds::seeds(seeds, "cluster", "Redis Cluster seed")?;
        let name: Arc<str> = name.into();
        let address = identity::seeds_address("cluster", &seeds);
        let configure: Arc<Configure> = Arc::new(configure);
        let client = configure(defaults(ClusterClientBuilder::new(seeds.clone())))
            .build()
            .map_err(|e| ConfigError::new(format!("{name}: {e}")))?;
        let attempt = connect(&runtime, client.clone(), name.clone(), None);
        let builder: Arc<ClusterBuilder> =
            Arc::new(move || configure(defaults(ClusterClientBuilder::new(seeds.clone()))));
        let hub = Hub::cluster(name.clone(), builder);
        Ok(ClusterNode {
            inner: Arc::new(Inner {
                name,
                address,
                client,
                runtime,
                connecting: Mutex::new(Connecting {
                    started: Instant::now(),
                    attempt,
                }),
                hub,
                line: Line::new(),
            }),
            wait: None,
        })
    }

    /// Counts this node's vote only once `replicas` replicas of the shard acknowledged
    /// the write, within `timeout` (`WAIT replicas timeout`, pipelined behind the
    /// acquire, extend and raise-fence commands on the same connection); `replicas = 0`
    /// turns it off. See [`RedisNode::wait_for_replicas`](crate::RedisNode::wait_for_replicas)
    /// for what it buys and what it costs. Applies to this handle and its later clones.
    #[must_use]
    pub fn wait_for_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.wait = (replicas > 0).then_some(ReplicaWait { replicas, timeout });
        self
    }
}

/// Retries that fit the locker's per-node timeout: redirections are followed at once,
/// and the waits between other retries stay short (redis-rs's defaults start at 1.28 s).
/// Commands go out at once (`TCP_NODELAY`), as a [`RedisNode`](crate::RedisNode)'s do;
/// a `configure` closure may set other [`TcpSettings`] (see
/// [`RedisNode::tcp_nodelay`](crate::RedisNode::tcp_nodelay) for the trade-off).
fn defaults(builder: ClusterClientBuilder) -> ClusterClientBuilder {
    builder
        .tcp_settings(TcpSettings::default().set_nodelay(true))
        .retries(5)
        .min_retry_wait(5)
        .max_retry_wait(500)
        .retry_wait_formula(10, 2)
}

fn connection_config() -> ClusterConfig {
    ClusterConfig::new().set_connection_timeout(Duration::from_secs(2))
}

/// Connects to the cluster (seeds, topology, masters) in a task of its own, so that
/// the attempt completes even when the callers waiting for it give up (their per-node
/// timeout is much shorter), and keeps its error, such as a failed authentication.
fn connect(
    runtime: &tokio::runtime::Handle,
    client: ClusterClient,
    name: Arc<str>,
    not_before: Option<Instant>,
) -> Connect {
    let attempt = async move {
        if let Some(at) = not_before {
            tokio::time::sleep_until(at).await;
        }
        client
            .get_async_connection_with_config(connection_config())
            .await
            .map_err(|e| {
                let e = call::node_error(e);
                tracing::warn!(node = %name, error = %e, "cannot connect to the cluster");
                NodeError::Connection(
                    format!("cannot connect to the cluster: {}", call::detail(&e)).into(),
                )
            })
    }
    .boxed()
    .shared();
    runtime.spawn(attempt.clone());
    attempt
}

impl Inner {
    /// The cluster connection, waiting for the attempt in progress, and the caller's
    /// place in line if it had to wait (to be given to [`in_turn`] with its command);
    /// a failed attempt is made again (at most every [`RECONNECT_INTERVAL`]).
    async fn connection(&self) -> Result<(ClusterConnection, Option<Place<'_>>), NodeError> {
        let attempt = self
            .connecting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .attempt
            .clone();
        let place = self.line.place(attempt.peek().is_none());
        match attempt.clone().await {
            Ok(conn) => Ok((conn, place)),
            Err(e) => {
                let mut connecting = self.connecting.lock().unwrap_or_else(|p| p.into_inner());
                if connecting.attempt.ptr_eq(&attempt) {
                    let not_before = connecting.started + RECONNECT_INTERVAL;
                    connecting.started = Instant::now().max(not_before);
                    connecting.attempt = connect(
                        &self.runtime,
                        self.client.clone(),
                        self.name.clone(),
                        Some(not_before),
                    );
                }
                Err(e)
            }
        }
    }
}

fn node_error(e: CallError) -> NodeError {
    e.into_node_error()
}

impl Node for ClusterNode {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn acquire(&self, request: &AcquireRequest<'_>) -> NodeFuture<AcquireReply> {
        let call = Acquire::new(request, true);
        let inner = self.inner.clone();
        let wait = self.wait;
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, call.run(&mut conn, wait))
                .await
                .map_err(node_error)
        })
    }

    fn extend(&self, keys: &LockKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        let call = ExtendCall::new(keys, owner, ttl);
        let inner = self.inner.clone();
        let wait = self.wait;
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, call::extend(&mut conn, &call, wait))
                .await
                .map_err(node_error)
        })
    }

    fn release(&self, keys: &LockKeys, owner: &Owner) -> NodeFuture<bool> {
        let call = ReleaseCall::new(keys, owner, true);
        let inner = self.inner.clone();
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, call::release(&mut conn, &call))
                .await
                .map_err(node_error)
        })
    }

    fn raise_fence(&self, keys: &LockKeys, token: u64, fence_ttl: Duration) -> NodeFuture<()> {
        let call = RaiseFenceCall::new(keys, token, fence_ttl);
        let inner = self.inner.clone();
        let wait = self.wait;
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, call::raise_fence(&mut conn, &call, wait))
                .await
                .map_err(node_error)
        })
    }

    fn subscribe(&self, keys: &LockKeys) -> NodeFuture<ReleaseSignal> {
        let channel = keys.channel.clone();
        let hub = self.inner.hub.clone();
        Box::pin(async move { hub.subscribe(channel).await })
    }

    fn address(&self) -> Option<&str> {
        Some(&self.inner.address)
    }

    /// The `run_id` of every master of the cluster.
    fn server_ids(&self) -> NodeFuture<Vec<String>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            // Not a lock command: it keeps no place in line.
            let (mut conn, _) = inner.connection().await?;
            let mut cmd = redis::cmd("INFO");
            cmd.arg("server");
            let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
            let answers = conn
                .route_command(cmd, routing)
                .await
                .map_err(call::node_error)?;
            let Value::Map(answers) = answers else {
                return Err(NodeError::Protocol(
                    format!("INFO on every master returned {answers:?}").into(),
                ));
            };
            Ok(answers
                .iter()
                .filter_map(|(_, info)| match info {
                    Value::BulkString(text) => {
                        identity::parse_run_id(&String::from_utf8_lossy(text))
                    }
                    Value::VerbatimString { text, .. } => identity::parse_run_id(text),
                    _ => None,
                })
                .collect())
        })
    }

    /// The role and eviction policy of every master, and the permissions of the user
    /// on the master that owns the probe's slot (a cluster's users are set per server;
    /// the others are expected to match).
    fn server_setup(&self, probe: &LockKeys) -> NodeFuture<Vec<ServerSetup>> {
        let inner = self.inner.clone();
        let probe = probe.clone();
        Box::pin(async move {
            let (mut conn, _) = inner.connection().await?;
            let mut setups: Vec<ServerSetup> = Vec::new();
            for section in ["memory", "replication"] {
                let mut cmd = redis::cmd("INFO");
                cmd.arg(section);
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let answers = conn
                    .route_command(cmd, routing)
                    .await
                    .map_err(call::node_error)?;
                let Value::Map(answers) = answers else {
                    return Err(NodeError::Protocol(
                        format!("INFO on every master returned {answers:?}").into(),
                    ));
                };
                for (server, info) in answers {
                    let server = match server {
                        Value::BulkString(text) => String::from_utf8_lossy(&text).into_owned(),
                        Value::SimpleString(text) => text,
                        other => format!("{other:?}"),
                    };
                    let text = match info {
                        Value::BulkString(text) => String::from_utf8_lossy(&text).into_owned(),
                        Value::VerbatimString { text, .. } => text,
                        _ => continue,
                    };
                    let found = parse_info(server.clone(), &text);
                    match setups.iter_mut().find(|s| s.server == server) {
                        Some(setup) => {
                            setup.role = setup.role.take().or(found.role);
                            setup.maxmemory_policy =
                                setup.maxmemory_policy.take().or(found.maxmemory_policy);
                        }
                        None => setups.push(found),
                    }
                }
            }
            let mut permissions = ServerSetup::new(inner.name.to_string());
            setup::probe_permissions(&mut conn, &probe, &mut permissions).await?;
            if !permissions.refused.is_empty() || permissions.channels_refused {
                setups.push(permissions);
            }
            Ok(setups)
        })
    }

    fn wait_queue(&self) -> Option<&dyn WaitQueue> {
        Some(self)
    }

    fn shared_modes(&self) -> Option<&dyn SharedModes> {
        Some(self)
    }

    fn records(&self) -> Option<&dyn RecordStore> {
        Some(self)
    }
}

impl WaitQueue for ClusterNode {
    fn hand_back(&self, keys: &LockKeys, owner: &Owner, waiter: &Waiter) -> NodeFuture<bool> {
        let call = ReleaseCall::hand_back(keys, owner, waiter, true);
        let inner = self.inner.clone();
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, call::release(&mut conn, &call))
                .await
                .map_err(node_error)
        })
    }

    fn release_as_waiter(
        &self,
        keys: &LockKeys,
        owner: &Owner,
        waiter: &Waiter,
    ) -> NodeFuture<bool> {
        let call = ReleaseCall::as_waiter(keys, owner, waiter, true);
        let inner = self.inner.clone();
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, call::release(&mut conn, &call))
                .await
                .map_err(node_error)
        })
    }

    fn leave_queue(&self, keys: &LockKeys, waiter: &Waiter) -> NodeFuture<()> {
        let call = ReleaseCall::leave(keys, waiter, true);
        let inner = self.inner.clone();
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, call::release(&mut conn, &call))
                .await
                .map(|_| ())
                .map_err(node_error)
        })
    }

    fn listen_for_release(&self, keys: &LockKeys, ttl: Duration) -> NodeFuture<()> {
        let call = ListenCall::new(keys, ttl);
        let inner = self.inner.clone();
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, call::listen(&mut conn, &call))
                .await
                .map_err(node_error)
        })
    }
}

impl RecordStore for ClusterNode {
    // Outcome records (idempotent replay): the commands are those of the standalone
    // node (`records.rs`). The record key carries the lock key's hash tag, so each
    // script's keys share one slot and the cluster client routes the call, `WAIT`
    // included, to the shard that owns the lock.
    fn read_record(&self, keys: &LockKeys) -> NodeFuture<Option<Record>> {
        let keys = keys.clone();
        let inner = self.inner.clone();
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, records::read(&mut conn, &keys))
                .await
                .map_err(node_error)
        })
    }

    fn claim_record(&self, request: &ClaimRequest<'_>) -> NodeFuture<ClaimReply> {
        let call = records::ClaimCall::new(request);
        let inner = self.inner.clone();
        let wait = self.wait;
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, records::claim(&mut conn, &call, wait))
                .await
                .map_err(node_error)
        })
    }

    fn store_record(&self, request: &StoreRequest<'_>) -> NodeFuture<StoreReply> {
        let call = records::StoreCall::new(request);
        let inner = self.inner.clone();
        let wait = self.wait;
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, records::store(&mut conn, &call, wait))
                .await
                .map_err(node_error)
        })
    }

    fn discard_record(&self, keys: &LockKeys, token: u64) -> NodeFuture<bool> {
        let call = records::DiscardCall::new(keys, token);
        let inner = self.inner.clone();
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, records::discard(&mut conn, &call))
                .await
                .map_err(node_error)
        })
    }
}

impl fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterNode")
            .field("name", &self.inner.name)
            .field("wait_for_replicas", &self.wait)
            .finish()
    }
}
