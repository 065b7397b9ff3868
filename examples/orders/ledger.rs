//! The orders demo's ledger: what the lock protects (see `main.rs`). Counts payments
//! and shipments per order, the most handlers ever inside one order at once
//! (`max_in_flight`), and refuses a write whose fencing token is below one it accepted
//! (in Redis through the crate's guarded write, `tower_redlock::fence::redis`); in Redis
//! (`LEDGER_URL`), in this process, or in PostgreSQL (`DATABASE_URL`, `postgres.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::IntoConnectionInfo;
use tokio::sync::OnceCell;
use tower_redlock::fence::{self, FenceError};
use tower_redlock::{FencingToken, Resource};

use super::BoxError;

/// What is recorded for an order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// A payment (`pay`).
    Payment,
    /// A shipment (`ship`).
    Shipment,
}

impl Entry {
    fn field(self) -> &'static str {
        match self {
            Entry::Payment => "payments",
            Entry::Shipment => "shipments",
        }
    }
}

/// What the ledger knows of one order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OrderRecord {
    /// Payments recorded.
    pub payments: u64,
    /// Shipments recorded.
    pub shipments: u64,
    /// Handlers working on the order right now.
    pub in_flight: i64,
    /// The most handlers that ever worked on the order at once: 1 under the lock.
    pub max_in_flight: i64,
    /// The fencing token of the last accepted write.
    pub last_token: Option<u64>,
}

/// Why the ledger refused.
#[derive(Debug)]
pub enum LedgerError {
    /// A larger fencing token than the writer's was accepted: its lease ended and
    /// another holder wrote since.
    Stale {
        /// The refused token.
        token: FencingToken,
        /// The last accepted token.
        last: u64,
    },
    /// The ledger's store did not answer.
    Unavailable(String),
}

impl From<redis::RedisError> for LedgerError {
    fn from(error: redis::RedisError) -> Self {
        LedgerError::Unavailable(error.to_string())
    }
}

/// Payments and shipments per order, shared by every instance with the same
/// `LOCK_URLS` (or by this process only). Cheap to clone.
#[derive(Clone)]
pub struct Ledger {
    pub(super) store: Store,
}

#[derive(Clone)]
pub(super) enum Store {
    Memory(Arc<Mutex<HashMap<String, OrderRecord>>>),
    #[cfg(feature = "postgres")]
    Postgres(super::postgres::PgLedger),
    Redis {
        connection: LedgerConnection,
        scripts: Arc<Scripts>,
    },
}

/// One Lua script per ledger step, so that each step is atomic in Redis.
pub(super) struct Scripts {
    enter: redis::Script,
    leave: redis::Script,
}

// KEYS[1]: the order's hash. A handler starts working on the order: count it in
// flight, and keep the largest count ever seen.
pub(super) const ENTER: &str = r"
local n = redis.call('HINCRBY', KEYS[1], 'in_flight', 1)
local max = tonumber(redis.call('HGET', KEYS[1], 'max_in_flight') or '0')
if n > max then
  redis.call('HSET', KEYS[1], 'max_in_flight', n)
end
return n
";

// KEYS[1]: the order's hash. A handler stopped without recording anything.
pub(super) const LEAVE: &str = r"
return redis.call('HINCRBY', KEYS[1], 'in_flight', -1)
";

impl Ledger {
    /// A ledger in this process.
    pub fn in_memory() -> Ledger {
        Ledger {
            store: Store::Memory(Arc::default()),
        }
    }

    /// A ledger in the Redis at `url`: a server (`redis://`), a Cluster
    /// (`redis+cluster://`) or a Sentinel group's master (`redis+sentinel://`), as a
    /// lock node URL names them. Connects on first use.
    pub fn redis(url: &str) -> Result<Ledger, BoxError> {
        let connection = LedgerConnection::open(url).map_err(|e| {
            format!("the ledger's Redis URL {url:?} (LEDGER_URL, or first in LOCK_URLS): {e}")
        })?;
        Ok(Ledger {
            store: Store::Redis {
                connection,
                scripts: Arc::new(Scripts {
                    enter: redis::Script::new(ENTER),
                    leave: redis::Script::new(LEAVE),
                }),
            },
        })
    }

    /// Creates the tables of a ledger in PostgreSQL (also created on first use).
    pub async fn prepare(&self) -> Result<(), LedgerError> {
        match &self.store {
            #[cfg(feature = "postgres")]
            Store::Postgres(pg) => pg.prepare().await,
            _ => Ok(()),
        }
    }

    /// Replay's records beside a ledger in PostgreSQL.
    #[cfg(feature = "postgres")]
    pub fn records(&self) -> Option<tower_redlock::http::replay::PgRecords> {
        match &self.store {
            Store::Postgres(pg) => Some(pg.records()),
            _ => None,
        }
    }

    /// A ledger in the PostgreSQL at `url` (`DATABASE_URL`): its tables are created on
    /// first use, every write is fenced (`tower_redlock::fence::postgres`).
    #[cfg(feature = "postgres")]
    pub fn postgres(url: &str) -> Result<Ledger, BoxError> {
        Ok(Ledger {
            store: Store::Postgres(super::postgres::PgLedger::connect_lazy(url)?),
        })
    }

    fn key(order: &str) -> String {
        format!("orders-example:ledger:{order}")
    }

    /// A handler starts working on `order`. Record with the returned [`Visit`].
    pub async fn enter(&self, order: &str) -> Result<Visit, LedgerError> {
        match &self.store {
            Store::Memory(orders) => {
                let mut orders = lock(orders);
                let record = orders.entry(order.to_owned()).or_default();
                record.in_flight += 1;
                record.max_in_flight = record.max_in_flight.max(record.in_flight);
            }
            #[cfg(feature = "postgres")]
            Store::Postgres(pg) => pg.enter(order).await?,
            Store::Redis {
                connection,
                scripts,
            } => {
                let _: i64 = scripts
                    .enter
                    .key(Self::key(order))
                    .invoke_async(&mut connection.get().await?)
                    .await?;
            }
        }
        Ok(Visit {
            ledger: self.clone(),
            order: order.to_owned(),
            open: true,
        })
    }

    /// What the ledger knows of `order` (zeros for an unknown order).
    pub async fn order(&self, order: &str) -> Result<OrderRecord, LedgerError> {
        match &self.store {
            Store::Memory(orders) => Ok(lock(orders).get(order).cloned().unwrap_or_default()),
            #[cfg(feature = "postgres")]
            Store::Postgres(pg) => pg.order(order).await,
            Store::Redis { connection, .. } => {
                let mut connection = connection.get().await?;
                let fields: Vec<Option<String>> = redis::cmd("HMGET")
                    .arg(Self::key(order))
                    .arg(&["payments", "shipments", "in_flight", "max_in_flight"])
                    .query_async(&mut connection)
                    .await?;
                let last_token = fence::redis::current(&mut connection, &Self::key(order)).await?;
                let number = |i: usize| -> Result<Option<i64>, LedgerError> {
                    match fields.get(i).cloned().flatten() {
                        None => Ok(None),
                        Some(text) => text.parse().map(Some).map_err(|_| {
                            LedgerError::Unavailable(format!("ledger field {i} is {text:?}"))
                        }),
                    }
                };
                let count = |i: usize| number(i).map(|n| n.unwrap_or(0).max(0) as u64);
                Ok(OrderRecord {
                    payments: count(0)?,
                    shipments: count(1)?,
                    in_flight: number(2)?.unwrap_or(0),
                    max_in_flight: number(3)?.unwrap_or(0),
                    last_token: last_token.map(FencingToken::get),
                })
            }
        }
    }
}

/// How the ledger reaches its Redis. One key per order, so a Cluster runs each script
/// on the order's shard.
#[derive(Clone)]
pub(super) enum LedgerConnection {
    /// A server: one connection that reconnects by itself.
    Server(ConnectionManager),
    /// A Cluster: one connection, made on first use, that follows redirections.
    Cluster(Arc<(ClusterClient, OnceCell<ClusterConnection>)>),
    /// A Sentinel group: the current master is asked for on every step, so the ledger
    /// follows a failover (a demo can afford the extra round trips).
    Sentinel(Arc<tokio::sync::Mutex<SentinelClient>>),
}

/// One connection of a [`LedgerConnection`], for one step.
pub(super) enum LedgerConn {
    Server(ConnectionManager),
    Cluster(ClusterConnection),
    Master(MultiplexedConnection),
}

impl LedgerConnection {
    fn open(url: &str) -> redis::RedisResult<LedgerConnection> {
        let invalid = |what: &str| {
            redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "invalid URL",
                what.to_owned(),
            ))
        };
        let (scheme, rest) = url.split_once("://").ok_or_else(|| invalid("no scheme"))?;
        let base = if scheme.starts_with("rediss") {
            "rediss"
        } else {
            "redis"
        };
        // `[userinfo@]host1,host2[/path][?query]`: one URL per host for redis-rs.
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(end);
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (format!("{userinfo}@"), hosts),
            None => (String::new(), authority),
        };
        let hosts = hosts.split(',').filter(|h| !h.is_empty());
        match scheme {
            "redis+cluster" | "rediss+cluster" => {
                let seeds: Vec<String> = hosts
                    .map(|host| format!("{base}://{userinfo}{host}"))
                    .collect();
                Ok(LedgerConnection::Cluster(Arc::new((
                    ClusterClient::new(seeds)?,
                    OnceCell::new(),
                ))))
            }
            "redis+sentinel" | "rediss+sentinel" => {
                // `/master[/db]`; the credentials are the master's, as for a lock node.
                let path = path.split('?').next().unwrap_or_default();
                let mut segments = path.trim_matches('/').split('/');
                let master = segments.next().filter(|m| !m.is_empty());
                let master = master.ok_or_else(|| invalid("a sentinel URL names its master"))?;
                let db = segments.next().unwrap_or("0");
                let master_info =
                    format!("redis://{userinfo}localhost/{db}").into_connection_info()?;
                let sentinels: Vec<String> = hosts.map(|host| format!("{base}://{host}")).collect();
                let client = SentinelClient::build(
                    sentinels,
                    String::from(master),
                    Some(
                        SentinelNodeConnectionInfo::default()
                            .set_redis_connection_info(master_info.redis_settings().clone()),
                    ),
                    SentinelServerType::Master,
                )?;
                Ok(LedgerConnection::Sentinel(Arc::new(
                    tokio::sync::Mutex::new(client),
                )))
            }
            _ => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(2)))
                    .set_response_timeout(Some(Duration::from_secs(2)));
                let client = redis::Client::open(url)?;
                Ok(LedgerConnection::Server(
                    ConnectionManager::new_lazy_with_config(client, config)?,
                ))
            }
        }
    }

    pub(super) async fn get(&self) -> redis::RedisResult<LedgerConn> {
        Ok(match self {
            LedgerConnection::Server(conn) => LedgerConn::Server(conn.clone()),
            LedgerConnection::Cluster(cluster) => {
                let (client, conn) = &**cluster;
                LedgerConn::Cluster(
                    conn.get_or_try_init(|| client.get_async_connection())
                        .await?
                        .clone(),
                )
            }
            LedgerConnection::Sentinel(client) => {
                LedgerConn::Master(client.lock().await.get_async_connection().await?)
            }
        })
    }
}

impl ConnectionLike for LedgerConn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            LedgerConn::Server(c) => c.req_packed_command(cmd),
            LedgerConn::Cluster(c) => c.req_packed_command(cmd),
            LedgerConn::Master(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            LedgerConn::Server(c) => c.req_packed_commands(pipeline, offset, count),
            LedgerConn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            LedgerConn::Master(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            LedgerConn::Server(c) => c.get_db(),
            LedgerConn::Cluster(c) => c.get_db(),
            LedgerConn::Master(c) => c.get_db(),
        }
    }
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere does not make the counters wrong: keep serving.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A handler at work on an order, between [`Ledger::enter`] and [`Visit::record`].
/// Dropped without recording (the handler was stopped), it leaves the in-flight count.
pub struct Visit {
    ledger: Ledger,
    order: String,
    open: bool,
}

impl Visit {
    /// Records `entry` with the writer's fencing token, and leaves. Refused when a
    /// larger token was accepted before (the rule of `tower_redlock::fence`; in Redis
    /// through `fence::redis`). Returns the entry's number.
    pub async fn record(mut self, entry: Entry, token: FencingToken) -> Result<u64, LedgerError> {
        self.open = false;
        match &self.ledger.store {
            Store::Memory(orders) => {
                let mut orders = lock(orders);
                let record = orders.entry(self.order.clone()).or_default();
                record.in_flight -= 1;
                if let Some(last) = record.last_token.filter(|&last| last > token.get()) {
                    return Err(LedgerError::Stale { token, last });
                }
                record.last_token = Some(token.get());
                let count = match entry {
                    Entry::Payment => &mut record.payments,
                    Entry::Shipment => &mut record.shipments,
                };
                *count += 1;
                Ok(*count)
            }
            #[cfg(feature = "postgres")]
            Store::Postgres(pg) => pg.record(&self.order, entry, token).await,
            Store::Redis {
                connection,
                scripts,
            } => {
                let key = Ledger::key(&self.order);
                let mut connection = connection.get().await?;
                let _: i64 = scripts
                    .leave
                    .key(&key)
                    .invoke_async(&mut connection)
                    .await?;
                let count: Option<u64> = redis::cmd("HGET")
                    .arg(&key)
                    .arg(entry.field())
                    .query_async(&mut connection)
                    .await?;
                let number = count.unwrap_or(0) + 1;
                // The crate's guarded write: the count is written only if no later
                // holder of the order's lock wrote before (its token is kept beside
                // the order's hash, `fence::redis::fence_key`). The token is the
                // order's exclusive lease's.
                let fields = [(entry.field(), number)];
                let held = (Resource::from(key.as_str()), token);
                match fence::redis::set_fields(&mut connection, &held, &key, &fields).await {
                    Ok(()) => Ok(number),
                    Err(FenceError::Stale { current, .. }) => Err(LedgerError::Stale {
                        token,
                        last: current.get(),
                    }),
                    Err(other) => Err(LedgerError::Unavailable(other.to_string())),
                }
            }
        }
    }
}

impl Drop for Visit {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        match &self.ledger.store {
            Store::Memory(orders) => {
                if let Some(record) = lock(orders).get_mut(&self.order) {
                    record.in_flight -= 1;
                }
            }
            #[cfg(feature = "postgres")]
            Store::Postgres(pg) => pg.leave_in_background(&self.order),
            Store::Redis {
                connection,
                scripts,
            } => {
                // Drop cannot wait: leave in the background.
                let (connection, scripts) = (connection.clone(), scripts.clone());
                let key = Ledger::key(&self.order);
                tokio::spawn(async move {
                    let left: Result<i64, _> = match connection.get().await {
                        Ok(mut connection) => {
                            scripts.leave.key(key).invoke_async(&mut connection).await
                        }
                        Err(error) => Err(error),
                    };
                    if let Err(error) = left {
                        tracing::warn!(%error, "ledger: leaving the in-flight count failed");
                    }
                });
            }
        }
    }
}
