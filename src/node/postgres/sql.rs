//! The statements of [`PostgresNode`](super::PostgresNode), one per call, and their
//! arguments as owned values (a node future is `'static`).
//!
//! Sent by default with the simple query protocol (a `&str` without arguments), values
//! written into the text as literals ([`Sql`](super::statement::Sql)): sqlx's extended protocol parses a
//! statement and executes it in two synchronisations, between which a pooler in
//! transaction mode may hand the connection to another client (and named prepared
//! statements would not follow). One statement, one round trip, on whatever server
//! connection; but planned on every call. With prepared statements (a direct
//! connection), the lock's calls are planned once per connection, their values bound.

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

/// `now + $n ms` on the database's clock.
macro_rules! expiry {
    ($n:literal) => {
        concat!(
            "clock_timestamp() + $",
            $n,
            "::float8 * interval '1 millisecond'"
        )
    };
}

/// A granted key's fence counter: `max(counter + 1, floor)`, or the floor over an
/// expired counter (`$8`: the unsafe seed-only rule, a test hook).
macro_rules! fence_step {
    () => {
        "ON CONFLICT (key) DO UPDATE SET
            counter = CASE WHEN c.expires_at <= clock_timestamp() THEN EXCLUDED.counter
                           WHEN $8::bool THEN c.counter + 1
                           ELSE greatest(c.counter + 1, EXCLUDED.counter) END,
            expires_at = EXCLUDED.expires_at"
    };
}

/// Grants every key or (a set, in its transaction) nothing. `$1` lock keys, `$2` fence
/// keys, `$3` owner, `$4` ttl ms, `$5` fencing, `$6` floor, `$7` fence ttl ms, `$8` the
/// unsafe seed-only rule (a test hook). The counters move only when every key was taken.
/// A held key's remaining ttl is read from the statement's snapshot: a holder that
/// committed while this statement waited for it is not in it (no pttl then).
const ACQUIRE: &str = concat!(
    "WITH wanted AS (
        SELECT lock_key, fence_key, idx
        FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS w(lock_key, fence_key, idx)
    ), taken AS (
        INSERT INTO redlock_leases AS l (key, owner, expires_at)
        SELECT lock_key, $3::text, ",
    expiry!(4),
    " FROM wanted ORDER BY idx
        ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at
        WHERE l.expires_at <= clock_timestamp() OR l.owner = EXCLUDED.owner
        RETURNING key
    ), fenced AS (
        INSERT INTO redlock_fence_counters AS c (key, counter, expires_at)
        SELECT fence_key, $6::int8, ",
    expiry!(7),
    " FROM wanted
        WHERE $5::bool AND (SELECT count(*) FROM taken) = cardinality($1::text[])
        ORDER BY idx
        ",
    fence_step!(),
    " RETURNING key, counter
    )
    SELECT t.key IS NOT NULL AS granted, f.counter,
           (extract(epoch FROM l.expires_at - clock_timestamp()) * 1000)::int8 AS pttl_ms
    FROM wanted w
    LEFT JOIN taken t ON t.key = w.lock_key
    LEFT JOIN fenced f ON f.key = w.fence_key
    LEFT JOIN redlock_leases l ON t.key IS NULL AND l.key = w.lock_key
    ORDER BY w.idx"
);

/// [`ACQUIRE`] of one key, the common case: the same rule on scalars, planned in a
/// third of the time (no `unnest`, no joins). A refused key's remaining ttl is asked
/// for by [`PTTL`] afterwards: read here, it would double the planning of every grant.
const ACQUIRE_ONE: &str = concat!(
    "WITH taken AS (
        INSERT INTO redlock_leases AS l (key, owner, expires_at)
        VALUES ($1::text, $3::text, ",
    expiry!(4),
    ") ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at
        WHERE l.expires_at <= clock_timestamp() OR l.owner = EXCLUDED.owner
        RETURNING key
    ), fenced AS (
        INSERT INTO redlock_fence_counters AS c (key, counter, expires_at)
        SELECT $2::text, $6::int8, ",
    expiry!(7),
    " FROM taken WHERE $5::bool ",
    fence_step!(),
    " RETURNING counter
    )
    SELECT EXISTS (SELECT FROM taken), (SELECT counter FROM fenced), NULL::int8"
);

/// The remaining ttl of the lease on `$1`, after [`ACQUIRE_ONE`] was refused.
const PTTL: &str = "SELECT (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::int8
    FROM redlock_leases WHERE key = $1::text";

/// Every hold of a renewal at once: `$1` keys, `$2` owners, `$3` each key's hold index,
/// `$4` ttl ms. Answers the number of keys extended per hold.
const EXTEND: &str = concat!(
    "WITH extended AS (
        UPDATE redlock_leases AS l SET expires_at = ",
    expiry!(4),
    " FROM unnest($1::text[], $2::text[], $3::int8[]) AS h(key, owner, hold)
        WHERE l.key = h.key AND l.owner = h.owner AND l.expires_at > clock_timestamp()
        RETURNING h.hold
    )
    SELECT hold, count(*) FROM extended GROUP BY hold"
);

/// Compare-and-delete: `$1` lock keys, `$2` their channels' names in notifications
/// (hex SHA-256: a channel may be longer than a payload), `$3` owner, `$4` wake.
/// Notifies each deleted key's channel, sent when this commits. Answers how many keys
/// were the owner's and still live.
const RELEASE: &str = "WITH gone AS (
        DELETE FROM redlock_leases AS l USING unnest($1::text[], $2::text[]) AS r(key, channel)
        WHERE l.key = r.key AND l.owner = $3::text
        RETURNING r.channel, l.expires_at > clock_timestamp() AS live
    )
    SELECT count(*) FILTER (WHERE live),
           count(CASE WHEN $4::bool THEN pg_notify('redlock_released', channel) END)
    FROM gone";

/// [`RELEASE`] of one key.
const RELEASE_ONE: &str = "WITH gone AS (
        DELETE FROM redlock_leases WHERE key = $1::text AND owner = $3::text
        RETURNING expires_at > clock_timestamp() AS live
    )
    SELECT count(*) FILTER (WHERE live),
           count(CASE WHEN $4::bool THEN pg_notify('redlock_released', $2::text) END)
    FROM gone";

/// `$1` fence keys, `$2` tokens, `$3` fence ttl ms.
const RAISE: &str = concat!(
    "INSERT INTO redlock_fence_counters AS c (key, counter, expires_at)
    SELECT key, token, ",
    expiry!(3),
    " FROM unnest($1::text[], $2::int8[]) AS r(key, token)
    ON CONFLICT (key) DO UPDATE SET
        counter = CASE WHEN c.expires_at <= clock_timestamp() THEN EXCLUDED.counter
                       ELSE greatest(c.counter, EXCLUDED.counter) END,
        expires_at = EXCLUDED.expires_at"
);

const EXISTING: &str = "SELECT to_regclass('redlock_leases') IS NOT NULL
    AND to_regclass('redlock_fence_counters') IS NOT NULL
    AND to_regclass('redlock_node_records') IS NOT NULL";

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
        pool.execute(create).await.map_err(node_error)?;
    }
    Ok(())
}

/// An acquire's statement (its values written in), and for one key what reads the
/// holder's remaining ttl if it is refused: the lock key, and whether it is prepared.
pub(super) type AcquireSql = (Statement, Option<(String, bool)>);

/// The acquire statement of `request`.
pub(super) fn acquire_sql(request: &Acquire<'_>, prepared: bool) -> Result<AcquireSql, NodeError> {
    let keys = request.keys;
    let pttl = match keys {
        [one] => Some((one.lock.clone(), prepared)),
        _ => None,
    };
    let sql = match keys {
        [one] => Sql::with(ACQUIRE_ONE, prepared)
            .text(&one.lock)
            .text(&one.fence),
        _ => Sql::with(ACQUIRE, prepared)
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
        .map(|acquire| (acquire, pttl))
}

/// Runs an acquire statement of one key (and `pttl` when it is refused), or of a set
/// (`set`).
pub(super) async fn acquire(
    pool: &PgPool,
    (query, pttl): AcquireSql,
    set: bool,
) -> Result<Vote, NodeError> {
    // One key writes nothing when it is held; a set's free members are written before
    // a held one is found, so a set runs in a transaction rolled back when refused.
    let mut tx = None;
    let rows = if set {
        let tx = tx.insert(pool.begin().await.map_err(node_error)?);
        query.fetch_all(&mut **tx).await
    } else {
        query.fetch_all(pool).await
    }
    .map_err(node_error)?;
    // (granted, fence counter, pttl ms) per key, in the request's order.
    let rows = rows
        .iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?)))
        .collect::<Result<Vec<(bool, Option<i64>, Option<i64>)>, sqlx::Error>>()
        .map_err(node_error)?;
    let vote = match rows.iter().position(|(granted, ..)| !granted) {
        Some(member) => {
            let mut ms = rows[member].2;
            if let Some((key, prepared)) = pttl {
                let read = Sql::with(PTTL, prepared).text(&key).statement()?;
                let row = read.fetch_all(pool).await.map_err(node_error)?;
                ms = row
                    .first()
                    .map(|r| r.try_get(0))
                    .transpose()
                    .map_err(node_error)?;
            }
            let pttl = ms
                .and_then(|ms| u64::try_from(ms).ok())
                .filter(|&ms| ms > 0);
            Vote::Held {
                member,
                pttl: pttl.map(Duration::from_millis),
            }
        }
        None => Vote::Granted {
            fences: PerKey::map(&rows, |(_, counter, _)| {
                counter.and_then(|c| u64::try_from(c).ok()).unwrap_or(0)
            }),
        },
    };
    if let Some(tx) = tx {
        match vote {
            Vote::Granted { .. } => tx.commit().await.map_err(node_error)?,
            _ => tx.rollback().await.map_err(node_error)?,
        }
    }
    Ok(vote)
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
    Sha256::digest(channel.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
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
