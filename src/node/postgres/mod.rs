//! [`PostgresNode`]: one PostgreSQL database as a lock node (feature `postgres`).

mod listener;
mod records;
mod sql;
mod statement;

pub(crate) use statement::Sql;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tokio::sync::OnceCell;

use crate::error::{ConfigError, NodeError};
use crate::node::percent::percent_decode;
use crate::node::{
    Acquire, Hold, Node, NodeFuture, RecordStore, Release, ReleaseSignal, ResourceKeys,
    ServerSetup, Vote,
};
use listener::Listener;

/// One PostgreSQL database as one lock node (feature `postgres`): leases as rows with an
/// expiry, fencing counters in a table, wake-ups through `LISTEN/NOTIFY`.
///
/// A team whose truth is a PostgreSQL database can lock with it alone: one database is
/// one node (its own replication is its durability), so a locker over one
/// `PostgresNode` needs no Redis. It may also vote beside Redis nodes (the fence rule is
/// the same).
///
/// # Mapping onto [`Node`]
///
/// Every call is one statement calling a function of the node's schema (below), so it
/// is atomic on the node; the functions' own statements are planned once per server
/// connection (PL/pgSQL keeps its plans), whether the call goes inline or prepared.
/// Expiry is compared with the database's clock (`clock_timestamp()`), never the
/// client's.
///
/// | operation | PostgreSQL |
/// |---|---|
/// | acquire | `redlock_acquire_one` (`redlock_acquire` for a set): `INSERT … ON CONFLICT (key) DO UPDATE … WHERE` the row has expired, `RETURNING`; in the same statement each granted key's fence counter becomes `max(counter + 1, fence_floor)`. A set's members written before a held one was found are rolled back inside the function (an exception block). A refused resource answers its holder's remaining ttl in the same call. |
/// | extend | `redlock_extend`: `UPDATE … SET expires_at = clock_timestamp() + ttl WHERE owner = $owner AND` not expired: compare-and-extend, every hold of a renewal in one call |
/// | release | `redlock_release_one` / `redlock_release`: `DELETE … WHERE owner = $owner` and `pg_notify` in the same statement (so the notification is sent when, and only if, the deletion commits) |
/// | raise the fence | `redlock_raise`: `INSERT … ON CONFLICT DO UPDATE SET counter = greatest(counter, token)` |
/// | wake-up | `LISTEN` on one channel per node, on a connection of its own (below) |
/// | outcome records | rows of `redlock_node_records`; a claim (`redlock_claim_record`) and a store (`redlock_store_record`) are one call each, which takes a transaction-scoped advisory lock on the record first (so they never interleave; nothing outlives the call) |
///
/// No advisory lock and no session state: every call runs on whatever connection the
/// pool hands out, so the node works behind PgBouncer in transaction pooling mode.
/// Shared and counted modes and the wait queue are not kept by this node kind (a locker
/// refuses the modes; a release wakes every waiter of the resource).
///
/// # Fencing tokens across restores and failovers
///
/// The counter step is `max(counter + 1, fence_floor)`, and the floor the engine sends
/// is the client's clock in ms × 1024 (see [`fencing`](crate::fencing)). A counters
/// table that comes back behind — a `pg_dump` restored, a failover to a replica that
/// had not replayed the last commits, the table truncated — restarts from the floor,
/// which is above every token handed out before (as long as the clients' clocks do not
/// go back by more than the time since): tokens never go back. A counter lives
/// `fence_ttl` after its last step; a row past it counts as missing.
///
/// # The tables
///
/// The tables and the functions are created on first use (`CREATE TABLE IF NOT EXISTS`,
/// `CREATE OR REPLACE FUNCTION`, after checking with `to_regclass` and `to_regprocedure`
/// that they are missing, so a role without `CREATE` works once they exist), or
/// beforehand by [`PostgresNode::create_tables`] or as a migration:
///
/// ```sql
#[doc = include_str!("tables.sql")]
/// ```
///
/// # LISTEN and poolers
///
/// `LISTEN` needs a session: the node opens one connection of its own for it (one per
/// node, shared by every waiter, reconnected when lost: every waiter is then woken once,
/// since a notification may have been missed), with the pool's connection options.
/// Behind a pooler in transaction mode a `LISTEN` hears nothing: give the listener a
/// direct URL to the server ([`with_listener_url`](PostgresNode::with_listener_url),
/// `?listen=<percent-encoded URL>` in the node's URL), or none
/// ([`without_listener`](PostgresNode::without_listener), `?listen=off`): waiters then
/// fall back on the locker's retry policy (polling).
///
/// # Example
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_redlock::{LockOptions, PostgresNode, Redlock};
///
/// // Never connects here: the pool connects on first use.
/// let node = PostgresNode::from_url(
///     "postgres://app:secret@pgbouncer:6432/shop?listen=postgres%3A%2F%2Fapp%3Asecret%40db%3A5432%2Fshop",
/// )?;
/// assert_eq!(node.name(), "postgres://pgbouncer:6432/shop");
/// let locker = Redlock::new([node], LockOptions::default())?;
/// # let _ = locker;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PostgresNode {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    pool: PgPool,
    /// Set once the tables are known to exist (see [`PostgresNode::create_tables`]).
    tables: OnceCell<()>,
    listener: Option<Arc<Listener>>,
    /// Where the listener connects, to build the node again with another setting.
    listen: Option<PgConnectOptions>,
    /// The lock's calls as prepared statements (see [`PostgresNode::prepared_statements`]).
    prepared: bool,
}

impl PostgresNode {
    /// A node on `pool`; its `LISTEN` connection uses the pool's connection options.
    pub fn new(pool: PgPool) -> Self {
        let options = (*pool.connect_options()).clone();
        Self::build(pool, Some(options), false)
    }

    /// A node from a URL `postgres://` or `postgresql://` (sqlx's form), with a lazily
    /// connected pool (10 connections). The parameter `listen` is the node's own:
    /// `listen=off`, or `listen=<percent-encoded URL>` for the `LISTEN` connection (see
    /// [LISTEN and poolers](PostgresNode#listen-and-poolers)); every other parameter
    /// goes to sqlx. Never connects.
    pub fn from_url(url: &str) -> Result<Self, ConfigError> {
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(ConfigError::new(
                "a PostgreSQL node URL starts with postgres:// or postgresql://",
            ));
        }
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let (mut listen, mut prepared) = (None, false);
        let mut rest = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("listen", value)) => listen = Some(percent_decode(value)?),
                Some(("statements", "prepared")) => prepared = true,
                Some(("statements", "inline")) => prepared = false,
                Some(("statements", other)) => {
                    return Err(ConfigError::new(format!(
                        "statements={other}: expected statements=prepared or statements=inline"
                    )))
                }
                _ => rest.push(pair),
            }
        }
        let url = match rest.is_empty() {
            true => base.to_owned(),
            false => format!("{base}?{}", rest.join("&")),
        };
        let pool = PgPoolOptions::new().connect_lazy_with(parse(&url)?);
        let node = Self::new(pool).prepared_statements(prepared);
        Ok(match listen.as_deref() {
            None => node,
            Some("off") => node.without_listener(),
            Some(listen) => node.with_listener_url(listen)?,
        })
    }

    /// This node with its `LISTEN` connection to `url` (direct to the server when the
    /// pool goes through a pooler in transaction mode).
    pub fn with_listener_url(self, url: &str) -> Result<Self, ConfigError> {
        let pool = self.inner.pool.clone();
        Ok(Self::build(pool, Some(parse(url)?), self.inner.prepared))
    }

    /// This node without a `LISTEN` connection: waiters poll (the retry policy).
    #[must_use]
    pub fn without_listener(self) -> Self {
        Self::build(self.inner.pool.clone(), None, self.inner.prepared)
    }

    /// This node with the lock's calls (acquire, extend, release, raising fences) sent as
    /// statements prepared once per connection, their values bound (`statements=prepared`
    /// in the URL), instead of inline in the simple query protocol (the default). The
    /// server then parses and plans each call once per connection instead of on every
    /// call (the functions' statements are planned once either way): about 1.1–1.2× the
    /// acquisitions per second on a local server (BENCHMARKS.md).
    ///
    /// Only on a direct connection, or a pooler that keeps prepared statements per
    /// client: behind PgBouncer in transaction mode before 1.21 (or without
    /// `max_prepared_statements`), a statement prepared on one server connection is
    /// missing on the next, and another client's statement of the same name may stand
    /// there instead.
    #[must_use]
    pub fn prepared_statements(self, prepared: bool) -> Self {
        Self::build(self.inner.pool.clone(), self.inner.listen.clone(), prepared)
    }

    fn build(pool: PgPool, listen: Option<PgConnectOptions>, prepared: bool) -> Self {
        let options = pool.connect_options();
        let name = format!(
            "postgres://{}:{}/{}",
            options.get_host().to_ascii_lowercase(),
            options.get_port(),
            options.get_database().unwrap_or_default()
        );
        PostgresNode {
            inner: Arc::new(Inner {
                name,
                pool,
                tables: OnceCell::new(),
                listener: listen.clone().map(Listener::new),
                listen,
                prepared,
            }),
        }
    }

    /// The node's name, `postgres://host:port/database`, without credentials.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Creates the node's tables if they are missing (idempotent); the node also does
    /// on first use. The statements are in the type's documentation.
    pub async fn create_tables(&self) -> Result<(), NodeError> {
        self.inner.tables().await
    }
}

fn parse(url: &str) -> Result<PgConnectOptions, ConfigError> {
    PgConnectOptions::from_str(url)
        .map_err(|e| ConfigError::new(format!("bad PostgreSQL URL: {e}")))
}

impl Inner {
    async fn tables(&self) -> Result<(), NodeError> {
        self.tables
            .get_or_try_init(|| sql::create_tables(&self.pool))
            .await
            .map(|_| ())
    }
}

/// Runs `call` on the node once its tables exist.
macro_rules! call {
    ($node:expr, |$inner:ident| $body:expr) => {{
        let $inner = $node.inner.clone();
        Box::pin(async move {
            $inner.tables().await?;
            $body.await
        })
    }};
}

impl Node for PostgresNode {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn address(&self) -> Option<&str> {
        Some(&self.inner.name)
    }

    fn acquire(&self, request: &Acquire<'_>) -> NodeFuture<Vote> {
        if !request.mode.is_exclusive() {
            return Box::pin(std::future::ready(Err(NodeError::Unsupported(
                "shared and counted leases".into(),
            ))));
        }
        let query = sql::acquire_sql(request, self.inner.prepared);
        call!(self, |inner| sql::acquire(&inner.pool, query?))
    }

    fn extend(
        &self,
        holds: &[Hold<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
        let query = sql::extend_sql(holds, ttl, self.inner.prepared);
        call!(self, |inner| async {
            let (query, sizes) = query?;
            sql::extend(&inner.pool, query, sizes).await
        })
    }

    fn release(&self, hold: &Hold<'_>, how: Release<'_>) -> NodeFuture<bool> {
        // Without a wait queue a release wakes the resource's channel, or nobody.
        let wake = matches!(how, Release::Wake | Release::AsWaiter(_));
        let query = sql::release_sql(hold, wake, self.inner.prepared);
        let keys = hold.keys.len();
        call!(self, |inner| sql::release(&inner.pool, query?, keys))
    }

    fn raise_fences(
        &self,
        keys: &[ResourceKeys],
        tokens: &[u64],
        fence_ttl: Duration,
    ) -> NodeFuture<()> {
        let query = sql::raise_sql(keys, tokens, fence_ttl, self.inner.prepared);
        call!(self, |inner| sql::execute(&inner.pool, query?))
    }

    fn subscribe(&self, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
        let listener = self.inner.listener.clone();
        let channel = keys.channel.clone();
        Box::pin(async move {
            match listener {
                Some(listener) => listener.subscribe(&channel).await,
                None => Err(NodeError::Unsupported(
                    "release notifications (the node has no LISTEN connection)".into(),
                )),
            }
        })
    }

    fn records(&self) -> Option<&dyn RecordStore> {
        Some(self)
    }

    /// The role only (`primary`, `standby` or `read-only`): a locker refuses the last two
    /// at connect, as it refuses a Redis replica.
    fn server_setup(&self, _probe: &ResourceKeys) -> NodeFuture<Vec<ServerSetup>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let mut setup = ServerSetup::new(inner.name.clone());
            setup.role = Some(sql::role(&inner.pool).await?);
            Ok(vec![setup])
        })
    }
}

impl std::fmt::Debug for PostgresNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresNode")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn urls() {
        let node = PostgresNode::from_url(
            "postgresql://u:p%40ss@DB.example:6432/app?listen=off&sslmode=disable",
        )
        .unwrap();
        assert_eq!(node.name(), "postgres://db.example:6432/app");
        assert!(node.inner.listener.is_none());
        let node =
            PostgresNode::from_url("postgres://h/app?listen=postgres%3A%2F%2Fdirect%3A5433%2Fapp")
                .unwrap();
        assert_eq!(node.name(), "postgres://h:5432/app");
        assert!(node.inner.listener.is_some());
        assert!(!node.inner.prepared);
        let node =
            PostgresNode::from_url("postgres://h/app?statements=prepared&listen=off").unwrap();
        assert!(node.inner.prepared && node.inner.listener.is_none());
        for (url, says) in [
            ("redis://h", "postgres://"),
            ("postgres://h/app?listen=%zz", "percent"),
            ("postgres://h/app?listen=nowhere", "bad PostgreSQL URL"),
            ("postgres://h/app?statements=cached", "statements=prepared"),
        ] {
            let err = PostgresNode::from_url(url)
                .map(|_| ())
                .expect_err(url)
                .to_string();
            assert!(err.contains(says), "{url}: {err}");
        }
    }
}
