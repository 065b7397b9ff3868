//! [`ClusterNode`]: one Redis Cluster as one lock node, over redis-rs's async cluster client.

use std::fmt;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::FutureExt;
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::io::tcp::TcpSettings;
use redis::{IntoConnectionInfo, Value};

use crate::error::{ConfigError, NodeError};
use crate::node::identity;
use crate::node::redis::attempt::{in_turn, Attempts, Connect};
use crate::node::redis::call::{self, Op, ReplicaWait};
use crate::node::redis::conn::Any;
use crate::node::redis::node::{redis_node, Redis, Route};
use crate::node::redis::pubsub::{ClusterBuilder, Hub};
use crate::node::redis::setup;
use crate::node::{parse_info, NodeFuture, ReleaseSignal, ResourceKeys, ServerSetup};

type Configure = dyn Fn(ClusterClientBuilder) -> ClusterClientBuilder + Send + Sync;

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
/// Release notifications use **sharded pub/sub** (Redis ≥ 7: `SPUBLISH`, `SSUBSCRIBE`)
/// over a second, RESP3 cluster connection, opened on first use; a subscription ended
/// by a moved slot or a dropped connection wakes its waiters to retry and is made again,
/// following the slot.
///
/// # Safety trade-offs
///
/// A cluster is one vote, as safe as its shards' **asynchronous** replication: a lock (or
/// fence counter, or outcome record) written shortly before a shard's failover may be
/// missing on the promoted replica, and a second client can then get the lock. A single
/// cluster scales throughput, not safety: for that, use several independent nodes,
/// [`wait_for_replicas`](ClusterNode::wait_for_replicas) and fencing tokens (see the
/// [stores guide](crate::guide::stores)).
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
    node: Redis<Cluster>,
}

/// redis-rs's cluster connection, which routes each call by its keys' slot.
pub(crate) struct Cluster {
    name: Arc<str>,
    address: String,
    /// The connection, once made. redis-rs keeps it working from then on (reconnects,
    /// topology refreshes); until then, failed attempts are made again on demand.
    connection: Attempts<ClusterConnection, NodeError>,
    /// Sharded pub/sub, over a connection of its own (see `pubsub.rs`).
    hub: Hub,
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
        let (seeds, name) = super::seeds(seeds, "cluster", "Redis Cluster seed")?;
        let name: Arc<str> = name.into();
        let address = identity::seeds_address("cluster", &seeds);
        let configure: Arc<Configure> = Arc::new(configure);
        let client = configure(defaults(ClusterClientBuilder::new(seeds.clone())))
            .build()
            .map_err(|e| ConfigError::new(format!("{name}: {e}")))?;
        // Connects to the cluster (seeds, topology, masters), keeping the error, such as
        // a failed authentication.
        let named = name.clone();
        let connect: Connect<ClusterConnection, NodeError> = Box::new(move |_| {
            let (client, name) = (client.clone(), named.clone());
            async move {
                let config = ClusterConfig::new().set_connection_timeout(Duration::from_secs(2));
                let made = client.get_async_connection_with_config(config).await;
                made.map_err(|e| {
                    let e = call::node_error(e);
                    tracing::warn!(node = %name, error = %e, "cannot connect to the cluster");
                    NodeError::Connection(
                        format!("cannot connect to the cluster: {}", call::detail(&e)).into(),
                    )
                })
            }
            .boxed()
        });
        let connection = Attempts::new(runtime, RECONNECT_INTERVAL, connect);
        connection.start_now();
        let builder: Arc<ClusterBuilder> =
            Arc::new(move || configure(defaults(ClusterClientBuilder::new(seeds.clone()))));
        let hub = Hub::cluster(name.clone(), builder);
        Ok(ClusterNode {
            node: Redis::new(Cluster {
                name,
                address,
                connection,
                hub,
            }),
        })
    }

    /// Counts this node's vote only once `replicas` replicas of the shard acknowledged
    /// the write, within `timeout` (`WAIT replicas timeout`, pipelined behind the
    /// acquire, extend and raise-fence commands on the same connection); `replicas = 0`
    /// turns it off. See [`RedisNode::wait_for_replicas`](crate::RedisNode::wait_for_replicas)
    /// for what it buys and what it costs. Applies to this handle and its later clones.
    #[must_use]
    pub fn wait_for_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.node.wait = (replicas > 0).then_some(ReplicaWait { replicas, timeout });
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

impl Cluster {
    /// `INFO section` on every master: each master's name and answer.
    async fn info_of_masters(&self, section: &str) -> Result<Vec<(String, String)>, NodeError> {
        let mut cmd = redis::cmd("INFO");
        cmd.arg(section);
        let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
        // Taken out of line at once: a command that keeps no place in it.
        let mut conn = self.connection.get().await.value?;
        let answers = conn
            .route_command(cmd, routing)
            .await
            .map_err(call::node_error)?;
        let Value::Map(answers) = answers else {
            return Err(NodeError::Protocol(
                format!("INFO on every master returned {answers:?}").into(),
            ));
        };
        let text = |value: Value| match value {
            Value::BulkString(text) => Some(String::from_utf8_lossy(&text).into_owned()),
            Value::VerbatimString { text, .. } | Value::SimpleString(text) => Some(text),
            _ => None,
        };
        Ok(answers
            .into_iter()
            .filter_map(|(server, info)| {
                let server = match server {
                    Value::BulkString(_) | Value::SimpleString(_) => text(server)?,
                    other => format!("{other:?}"),
                };
                Some((server, text(info)?))
            })
            .collect())
    }
}

impl Route for Cluster {
    const SHARDED: bool = true;

    fn names(&self) -> (&str, &str) {
        (&self.name, &self.address)
    }

    /// On the cluster connection, which routes by slot (redirections included), after
    /// the callers that waited for the connection before it (`attempt.rs`).
    async fn run<O: Op>(&self, op: &O, wait: Option<ReplicaWait>) -> Result<O::Output, NodeError> {
        let got = self.connection.get().await;
        let mut conn = got.value?;
        in_turn(got.place, pin!(op.run(&mut Any(&mut conn), wait)))
            .await
            .map_err(call::CallError::into_node_error)
    }

    fn subscribe(self: &Arc<Self>, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
        let channel = keys.channel.clone();
        let hub = self.hub.clone();
        Box::pin(async move { hub.subscribe(channel).await })
    }

    /// The `run_id` of every master of the cluster.
    fn server_ids(self: Arc<Self>) -> NodeFuture<Vec<String>> {
        Box::pin(async move {
            let answers = self.info_of_masters("server").await?;
            Ok(answers
                .iter()
                .filter_map(|(_, info)| identity::parse_run_id(info))
                .collect())
        })
    }

    /// The role and eviction policy of every master, and the permissions of the user
    /// on the master that owns the probe's slot (a cluster's users are set per server;
    /// the others are expected to match).
    fn server_setup(self: Arc<Self>, probe: ResourceKeys) -> NodeFuture<Vec<ServerSetup>> {
        Box::pin(async move {
            let mut setups: Vec<ServerSetup> = Vec::new();
            for section in ["memory", "replication"] {
                for (server, text) in self.info_of_masters(section).await? {
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
            let mut permissions = ServerSetup::new(self.name.to_string());
            let mut conn = self.connection.get().await.value?;
            setup::probe_permissions(&mut conn, &probe, true, &mut permissions).await?;
            if !permissions.refused.is_empty()
                || !permissions.missing.is_empty()
                || permissions.channels_refused
            {
                setups.push(permissions);
            }
            Ok(setups)
        })
    }
}

redis_node!(ClusterNode, Cluster);

impl fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterNode")
            .field("name", &self.node.route.name)
            .field("wait_for_replicas", &self.node.wait)
            .finish()
    }
}
