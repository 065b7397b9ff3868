//! The statements of [`PostgresNode`](super::PostgresNode), one call of a function of
//! its schema each, and their arguments as owned values (a node future is `'static`).
//!
//! Sent by default with the simple query protocol (a `&str` without arguments), values
//! written into the text as literals ([`Sql`](super::statement::Sql)): sqlx's extended
//! protocol parses a statement and executes it in two synchronisations, between which a
//! pooler in transaction mode may hand the connection to another client (and named
//! prepared statements would not follow). One call, one round trip, on whatever server
//! connection. Only the call is planned each time: the function's own statements keep
//! their plans in the server's connection (PL/pgSQL's plan cache), which inline
//! statements could not. With prepared statements (a direct connection), the call too is
//! planned once per connection, its values bound.

use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::postgres::PgPool;
use sqlx::{Executor, Row};

use super::statement::{Sql, Statement};

use crate::error::NodeError;
use crate::fence::to_i64;
use crate::node::{Acquire, FencingToken, Hold, PerKey, ResourceKeys, Vote};

/// The one channel every release notifies on; the payload names the resource's channel.
pub(super) const CHANNEL: &str = "redlock_released";

/// The lock's calls, each a function of the schema ([`tables.sql`](super::PostgresNode#the-tables)):
/// their statements are planned once per connection however the call is sent.
const ACQUIRE: &str = "SELECT * FROM redlock_acquire($1::text[], $2::text[], $3::text, \
     $4::float8, $5::bool, $6::int8, $7::float8, $8::bool)";
const ACQUIRE_ONE: &str = "SELECT * FROM redlock_acquire_one($1::text, $2::text, $3::text, \
     $4::float8, $5::bool, $6::int8, $7::float8, $8::bool)";
const EXTEND: &str = "SELECT * FROM redlock_extend($1::text[], $2::text[], $3::int8[], $4::float8)";
const RELEASE: &str = "SELECT redlock_release($1::text[], $2::text[], $3::text, $4::bool)";
const RELEASE_ONE: &str = "SELECT redlock_release_one($1::text, $2::text, $3::text, $4::bool)";
const RAISE: &str = "SELECT redlock_raise($1::text[], $2::int8[], $3::float8)";

/// Whether the schema is there: its tables, and its last function.
const EXISTING: &str = "SELECT to_regclass('redlock_leases') IS NOT NULL
    AND to_regclass('redlock_fence_counters') IS NOT NULL
    AND to_regclass('redlock_node_records') IS NOT NULL
    AND to_regprocedure('redlock_store_record(text, text, text, bigint, bytea, bytea, float8)')
        IS NOT NULL";

/// The server's role for [`ServerSetup::role`](crate::node::ServerSetup::role): a
/// standby (`pg_is_in_recovery()`) or a database read-only by default
/// (`transaction_read_only` of a statement outside a transaction block) fails every
/// lock write.
const ROLE: &str = "SELECT CASE WHEN pg_is_in_recovery() THEN 'standby'
    WHEN current_setting('transaction_read_only') = 'on' THEN 'read-only'
    ELSE 'primary' END";

pub(super) async fn role(pool: &PgPool) -> Result<String, NodeError> {
    let row = pool.fetch_one(ROLE).await.map_err(node_error)?;
    row.try_get(0).map_err(node_error)
}

pub(super) async fn create_tables(pool: &PgPool) -> Result<(), NodeError> {
    let row = pool.fetch_one(EXISTING).await.map_err(node_error)?;
    let exist: bool = row.try_get(0).map_err(node_error)?;
    if !exist {
        // Two first uses at once would both create the row types (a unique violation):
        // the statements run as one transaction, under a lock held until it ends.
        let create = concat!(
            "SELECT pg_advisory_xact_lock(7262657265636);",
            include_str!("tables.sql")
        );
        pool.execute(create).await.map_err(|e| {
            let denied =
                matches!(&e, sqlx::Error::Database(db) if db.code().as_deref() == Some("42501"));
            match node_error(e) {
                NodeError::Server(e) if denied => NodeError::Server(
                    format!(
                        "the node's tables or functions are missing and this role may not \
                         create them (run the migration `PostgresNode` documents as one that \
                         may): {e}"
                    )
                    .into(),
                ),
                other => other,
            }
        })?;
    }
    Ok(())
}

/// The acquire statement of `request`.
pub(super) fn acquire_sql(request: &Acquire<'_>, prepared: bool) -> Result<Statement, NodeError> {
    let sql = match request.keys {
        [one] => Sql::with(ACQUIRE_ONE, prepared)
            .text(&one.lock)
            .text(&one.fence),
        keys => Sql::with(ACQUIRE, prepared)
            .texts(keys.iter().map(|k| k.lock.as_str()))
            .texts(keys.iter().map(|k| k.fence.as_str())),
    };
    sql.text(request.owner.as_str())
        .number(millis(request.ttl))
        .number(request.fencing)
        .number(bigint(request.fence_floor)?)
        .number(millis(request.fence_ttl))
        .number(request.seed_only_when_missing)
        .statement()
}

/// Runs an acquire statement: granted with each key's fence counter, or the first
/// member held and its holder's remaining ttl.
pub(super) async fn acquire(pool: &PgPool, query: Statement) -> Result<Vote, NodeError> {
    let rows = query.fetch_all(pool).await.map_err(node_error)?;
    // (granted, fence counter, pttl ms) per key, in the request's order.
    let rows = rows
        .iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?)))
        .collect::<Result<Vec<(bool, Option<i64>, Option<i64>)>, sqlx::Error>>()
        .map_err(node_error)?;
    Ok(match rows.iter().position(|(granted, ..)| !granted) {
        Some(member) => Vote::Held {
            member,
            pttl: rows[member]
                .2
                .and_then(|ms| u64::try_from(ms).ok())
                .filter(|&ms| ms > 0)
                .map(Duration::from_millis),
        },
        None => Vote::Granted {
            fences: PerKey::map(&rows, |(_, counter, _)| {
                counter.and_then(|c| u64::try_from(c).ok()).unwrap_or(0)
            }),
        },
    })
}

/// The extend statement of every hold, and each hold's number of keys.
pub(super) fn extend_sql(
    holds: &[Hold<'_>],
    ttl: Duration,
    prepared: bool,
) -> Result<(Statement, Vec<usize>), NodeError> {
    let each = || {
        holds
            .iter()
            .enumerate()
            .flat_map(|(i, h)| h.keys.iter().map(move |k| (i, h, k)))
    };
    let query = Sql::with(EXTEND, prepared)
        .texts(each().map(|(_, _, k)| k.lock.as_str()))
        .texts(each().map(|(_, h, _)| h.owner.as_str()))
        .numbers(each().map(|(i, ..)| i as i64))
        .number(millis(ttl))
        .statement()?;
    Ok((query, holds.iter().map(|h| h.keys.len()).collect()))
}

pub(super) async fn extend(
    pool: &PgPool,
    query: Statement,
    sizes: Vec<usize>,
) -> Result<Vec<Result<bool, NodeError>>, NodeError> {
    let rows = query.fetch_all(pool).await.map_err(node_error)?;
    let mut extended = vec![0usize; sizes.len()];
    for row in rows {
        let hold: i64 = row.try_get(0).map_err(node_error)?;
        let count: i64 = row.try_get(1).map_err(node_error)?;
        if let Some(slot) = usize::try_from(hold).ok().and_then(|h| extended.get_mut(h)) {
            *slot = count as usize;
        }
    }
    Ok(extended
        .iter()
        .zip(&sizes)
        .map(|(done, size)| Ok(done == size))
        .collect())
}

pub(super) fn release_sql(
    hold: &Hold<'_>,
    wake: bool,
    prepared: bool,
) -> Result<Statement, NodeError> {
    let sql = match hold.keys {
        [one] => Sql::with(RELEASE_ONE, prepared)
            .text(&one.lock)
            .text(&notified(&one.channel)),
        keys => Sql::with(RELEASE, prepared)
            .texts(keys.iter().map(|k| k.lock.as_str()))
            .texts(keys.iter().map(|k| notified(&k.channel))),
    };
    sql.text(hold.owner.as_str()).number(wake).statement()
}

/// Runs a release statement of `keys` keys: whether every one was the owner's.
pub(super) async fn release(
    pool: &PgPool,
    query: Statement,
    keys: usize,
) -> Result<bool, NodeError> {
    let rows = query.fetch_all(pool).await.map_err(node_error)?;
    let row = rows
        .first()
        .ok_or(NodeError::Protocol("a release answered no row".into()))?;
    let live: i64 = row.try_get(0).map_err(node_error)?;
    Ok(live as usize == keys)
}

pub(super) fn raise_sql(
    keys: &[ResourceKeys],
    tokens: &[u64],
    fence_ttl: Duration,
    prepared: bool,
) -> Result<Statement, NodeError> {
    let tokens = tokens
        .iter()
        .map(|&t| bigint(t))
        .collect::<Result<Vec<_>, _>>()?;
    Sql::with(RAISE, prepared)
        .texts(keys.iter().map(|k| k.fence.as_str()))
        .numbers(tokens)
        .number(millis(fence_ttl))
        .statement()
}

pub(super) async fn execute(pool: &PgPool, query: Statement) -> Result<(), NodeError> {
    query.fetch_all(pool).await.map_err(node_error)?;
    Ok(())
}

/// A channel's name in a release's notification: its hex SHA-256, since a channel's
/// name may be longer than a notification's payload (and the listener compares hashes).
pub(super) fn notified(channel: &str) -> String {
    let mut hex = String::new();
    crate::push_hex(&mut hex, &Sha256::digest(channel.as_bytes()));
    hex
}

pub(super) fn millis(ttl: Duration) -> f64 {
    ttl.as_secs_f64() * 1000.0
}

/// A counter value as `bigint`: refused, never wrapped, past `i64::MAX`.
pub(super) fn bigint(value: u64) -> Result<i64, NodeError> {
    to_i64(FencingToken::new(value)).map_err(|e| NodeError::Protocol(e.to_string().into()))
}

/// Connection failures apart from the server's answers (the locker counts both as no
/// vote; logs and metrics tell them apart).
pub(super) fn node_error(e: sqlx::Error) -> NodeError {
    match e {
        sqlx::Error::Database(e) => NodeError::Server(e.to_string().into()),
        sqlx::Error::Protocol(e) => NodeError::Protocol(e.into()),
        other => NodeError::Connection(other.to_string().into()),
    }
}
