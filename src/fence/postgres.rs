//! Fences in PostgreSQL, advanced inside the application's own transaction (sqlx,
//! feature `postgres`).
//!
//! A fence is a row of the fence table: a resource's encoded name and the largest token
//! that wrote under it. [`advance`] (or [`FenceTable::advance`] for a table of another
//! name) runs one statement in the caller's transaction:
//!
//! ```sql
//! INSERT INTO redlock_fences (resource, token) VALUES ($1, $2)
//! ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token
//!     WHERE redlock_fences.token < EXCLUDED.token
//! RETURNING resource
//! ```
//!
//! A row back means the fence moved to the lease's token: go on with the transaction's
//! writes and commit. No row means the fence holds a token at least as large; only then
//! a second statement reads it (the row is locked by the first one, so it is the token
//! that won): equal is this lease's own earlier write (accepted), larger is
//! [`FenceError::Stale`] and the caller rolls back (dropping a sqlx `Transaction` does),
//! so nothing of that transaction commits. A lease over a set advances every member's
//! fence in the same one statement (`unnest` of two arrays, in canonical order, so two
//! sets never lock the same rows in opposite orders).
//!
//! # Isolation levels
//!
//! - **READ COMMITTED** (PostgreSQL's default): `ON CONFLICT DO UPDATE` waits for a
//!   concurrent transaction holding the row, then compares with the version that
//!   transaction committed. Of many transactions advancing one fence at once, each
//!   larger token wins over the smaller ones before it, and every refused one gets
//!   `Stale` with a token that won.
//! - **REPEATABLE READ / SERIALIZABLE**: a transaction whose snapshot predates a
//!   concurrent commit to the same fence fails with a serialization failure (SQLSTATE
//!   `40001`) instead: that is [`FenceError::Store`], not `Stale` — the database did not
//!   compare the tokens, so retry the whole transaction ([`is_retryable`] says which
//!   errors are worth it); the retry compares with the committed token. Either way the
//!   fence never goes backwards.
//!
//! # The table
//!
//! [`FenceTable::create`] creates it (idempotently); as a migration:
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS redlock_fences (
//!     resource text PRIMARY KEY,
//!     token bigint NOT NULL CHECK (token >= 0)
//! );
//! ```
//!
//! A token past `bigint` is refused with [`FenceError::OutOfRange`], never wrapped.
//!
//! # A row's own fence column
//!
//! When the row written carries its own fence (`orders.fence_token bigint NOT NULL
//! DEFAULT 0`), the guard fits in the application's `UPDATE`; no fence table needed:
//!
//! ```no_run
//! use sqlx::PgConnection;
//! use tower_redlock::fence::{self, FenceError};
//! use tower_redlock::FencingToken;
//!
//! async fn mark_paid(
//!     conn: &mut PgConnection,
//!     order: i64,
//!     token: FencingToken,
//! ) -> Result<(), FenceError<sqlx::Error>> {
//!     let bigint = fence::to_i64(token)?; // refused, never wrapped, past i64::MAX
//!     let updated = sqlx::query(
//!         "UPDATE orders SET status = 'paid', fence_token = $2
//!          WHERE id = $1 AND fence_token <= $2",
//!     )
//!     .bind(order)
//!     .bind(bigint)
//!     .execute(&mut *conn)
//!     .await
//!     .map_err(FenceError::Store)?;
//!     if updated.rows_affected() == 0 {
//!         // Stale, or no such order: the row's token tells which.
//!         let current: Option<i64> =
//!             sqlx::query_scalar("SELECT fence_token FROM orders WHERE id = $1")
//!                 .bind(order)
//!                 .fetch_optional(&mut *conn)
//!                 .await
//!                 .map_err(FenceError::Store)?;
//!         if let Some(current) = current {
//!             return Err(FenceError::Stale {
//!                 fence: format!("orders/{order}"),
//!                 token,
//!                 current: FencingToken::new(current as u64),
//!             });
//!         }
//!     }
//!     Ok(())
//! }
//! ```

use sqlx::PgConnection;

use super::{to_i64, writer_tokens, FenceError, Fenced};
use crate::error::ConfigError;
use crate::{FencingToken, Resource};

/// A fence table: where [`FenceTable::advance`] keeps each resource's largest token.
///
/// ```no_run
/// use tower_redlock::fence::postgres::FenceTable;
/// use tower_redlock::Redlock;
///
/// # async fn run(pool: sqlx::PgPool, locker: Redlock) -> Result<(), Box<dyn std::error::Error>> {
/// let fences = FenceTable::new("billing.fences")?;
/// fences.create(&mut *pool.acquire().await?).await?; // or run `fences.create_sql()` as a migration
///
/// let lease = locker.try_acquire("invoice:7").await?;
/// let mut tx = pool.begin().await?;
/// fences.advance(&mut tx, &lease).await?; // Stale: `?` drops `tx`, which rolls back
/// sqlx::query("UPDATE invoices SET sent = true WHERE id = 7").execute(&mut *tx).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceTable {
    /// The name as written in SQL: each part double-quoted.
    quoted: String,
    /// The statement advancing one fence.
    advance_one: String,
    /// The statement advancing the fences of a set.
    advance_many: String,
    /// The statement reading fences back after a refusal.
    read: String,
}

impl Default for FenceTable {
    fn default() -> Self {
        // The table [`advance`] uses.
        FenceTable::quoted("\"redlock_fences\"".to_owned())
    }
}

impl FenceTable {
    /// The table named `name`, optionally schema-qualified (`schema.table`); each part
    /// is a plain identifier (letters, digits, `_`, not starting with a digit, up to 63
    /// bytes), kept as written (quoted, so case matters).
    pub fn new(name: &str) -> Result<Self, ConfigError> {
        let parts: Vec<&str> = name.split('.').collect();
        let valid = |part: &str| {
            !part.is_empty()
                && part.len() <= 63
                && !part.as_bytes()[0].is_ascii_digit()
                && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        };
        if parts.len() > 2 || !parts.iter().all(|part| valid(part)) {
            return Err(ConfigError::new(format!(
                "fence table name {name:?}: expected `table` or `schema.table`, each part \
                 letters, digits and `_` (not starting with a digit, at most 63 bytes)"
            )));
        }
        let quoted = parts
            .iter()
            .map(|part| format!("\"{part}\""))
            .collect::<Vec<_>>()
            .join(".");
        Ok(FenceTable::quoted(quoted))
    }

    fn quoted(quoted: String) -> Self {
        let t = &quoted;
        // `ON CONFLICT … WHERE` names the existing row by the table's name; the alias
        // `f` keeps that short for a schema-qualified one.
        let advance_one = format!(
            "INSERT INTO {t} AS f (resource, token) VALUES ($1, $2) \
             ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token \
             WHERE f.token < EXCLUDED.token \
             RETURNING resource"
        );
        let advance_many = format!(
            "INSERT INTO {t} AS f (resource, token) \
             SELECT * FROM unnest($1::text[], $2::bigint[]) \
             ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token \
             WHERE f.token < EXCLUDED.token \
             RETURNING resource"
        );
        let read = format!("SELECT resource, token FROM {t} WHERE resource = ANY($1::text[])");
        FenceTable {
            quoted,
            advance_one,
            advance_many,
            read,
        }
    }

    /// For a statement that advances one resource's fence (`$1`, to the token `$2`) along
    /// with other work: the advance as the `WITH` query `name`, and a condition that
    /// holds, read after it, when the fence holds `$2` (advanced now, or by this lease
    /// before).
    pub(crate) fn advance_one_as(&self, name: &str) -> (String, String) {
        let (t, advance) = (&self.quoted, &self.advance_one);
        (
            format!("{name} AS ({advance})"),
            format!(
                "(EXISTS (SELECT FROM {name}) \
                 OR EXISTS (SELECT FROM {t} WHERE resource = $1 AND token = $2))"
            ),
        )
    }

    /// The `CREATE TABLE IF NOT EXISTS` statement, for a migration.
    pub fn create_sql(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (\n    resource text PRIMARY KEY,\n    \
             token bigint NOT NULL CHECK (token >= 0)\n)",
            self.quoted
        )
    }

    /// Creates the table if it does not exist (its schema must).
    pub async fn create(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query(&self.create_sql()).execute(conn).await?;
        Ok(())
    }

    /// The token a resource's fence holds (`None`: nothing has written under it).
    pub async fn current(
        &self,
        conn: &mut PgConnection,
        resource: &Resource,
    ) -> Result<Option<FencingToken>, sqlx::Error> {
        let rows: Vec<(String, i64)> = sqlx::query_as(&self.read)
            .bind(vec![resource.as_str().to_owned()])
            .fetch_all(conn)
            .await?;
        Ok(rows
            .first()
            .map(|(_, token)| FencingToken::new(*token as u64)))
    }

    /// Advances the fence of every resource `held` holds to its token, in `conn`'s
    /// transaction (pass `&mut tx`), or fails with [`FenceError::Stale`] when a fence
    /// holds a larger token. On `Stale` roll the transaction back: the statement wrote
    /// nothing, but the application's writes before it are still in the transaction.
    /// A holder that is not exclusive is refused with [`FenceError::NotExclusive`]
    /// before anything is sent (see [Writers only](super#writers-only)).
    ///
    /// Holding nothing (an empty set) advances nothing. Outside a transaction the fence
    /// moves on its own, which is rarely what a guard is for.
    pub async fn advance(
        &self,
        conn: &mut PgConnection,
        held: &(impl Fenced + ?Sized),
    ) -> Result<(), FenceError<sqlx::Error>> {
        let mut tokens = writer_tokens(held)?;
        if tokens.is_empty() {
            return Ok(());
        }
        // One lock order for every transaction: sets never deadlock on their fences.
        tokens.sort_by(|a, b| a.0.cmp(&b.0));
        tokens.dedup_by(|a, b| a.0 == b.0);
        let names: Vec<String> = tokens.iter().map(|(r, _)| r.as_str().to_owned()).collect();
        let values =
            (tokens.iter().map(|(_, token)| to_i64(*token))).collect::<Result<Vec<_>, _>>()?;
        let advanced: Vec<String> = if tokens.len() == 1 {
            sqlx::query_scalar(&self.advance_one)
                .bind(&names[0])
                .bind(values[0])
                .fetch_all(&mut *conn)
                .await
        } else {
            sqlx::query_scalar(&self.advance_many)
                .bind(&names)
                .bind(&values)
                .fetch_all(&mut *conn)
                .await
        }
        .map_err(FenceError::Store)?;
        if advanced.len() == tokens.len() {
            return Ok(());
        }
        // Some fence holds a token at least as large. Its row is locked by the statement
        // above (`ON CONFLICT DO UPDATE` locks the row even when its `WHERE` refuses), so
        // this reads the token that stands.
        let stored: Vec<(String, i64)> = sqlx::query_as(&self.read)
            .bind(&names)
            .fetch_all(&mut *conn)
            .await
            .map_err(FenceError::Store)?;
        for (name, token) in names.iter().zip(&values) {
            if advanced.contains(name) {
                continue;
            }
            let current = stored
                .iter()
                .find(|(stored, _)| stored == name)
                .map(|(_, current)| *current);
            match current {
                // This lease wrote under the fence before: its own token, accepted.
                Some(current) if current == *token => {}
                Some(current) if current > *token => {
                    return Err(FenceError::Stale {
                        fence: name.clone(),
                        token: FencingToken::new(*token as u64),
                        current: FencingToken::new(current as u64),
                    })
                }
                _ => {
                    return Err(FenceError::Store(sqlx::Error::Protocol(format!(
                        "fence {name:?} refused token {token} but holds {current:?}: is the \
                         fence table's `resource` its primary key?"
                    ))))
                }
            }
        }
        Ok(())
    }
}

/// Advances the fences of `held` in the default table, `redlock_fences`: see
/// [`FenceTable::advance`].
///
/// ```no_run
/// use tower_redlock::fence::{self, FenceError};
/// use tower_redlock::Redlock;
///
/// # async fn run(pool: sqlx::PgPool, locker: Redlock) -> Result<(), Box<dyn std::error::Error>> {
/// let lease = locker.try_acquire("order:42").await?;
/// let mut tx = pool.begin().await?;
/// match fence::postgres::advance(&mut tx, &lease).await {
///     Ok(()) => {}
///     // A later holder wrote: our lease is over. `tx` rolls back when dropped.
///     Err(FenceError::Stale { current, .. }) => return Err(format!("superseded by {current}").into()),
///     Err(other) => return Err(other.into()),
/// }
/// sqlx::query("UPDATE orders SET status = 'paid' WHERE id = 42").execute(&mut *tx).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
pub async fn advance(
    conn: &mut PgConnection,
    held: &(impl Fenced + ?Sized),
) -> Result<(), FenceError<sqlx::Error>> {
    default_table().advance(conn, held).await
}

pub(crate) fn default_table() -> &'static FenceTable {
    static TABLE: std::sync::OnceLock<FenceTable> = std::sync::OnceLock::new();
    TABLE.get_or_init(FenceTable::default)
}

/// `true` for the database errors worth retrying the whole transaction for: a
/// serialization failure (`40001`, REPEATABLE READ and SERIALIZABLE) and a deadlock
/// (`40P01`). Never for [`FenceError::Stale`]: a retry under the same token is refused
/// again.
pub fn is_retryable(error: &FenceError<sqlx::Error>) -> bool {
    match error {
        FenceError::Store(sqlx::Error::Database(db)) => {
            matches!(db.code().as_deref(), Some("40001" | "40P01"))
        }
        _ => false,
    }
}
