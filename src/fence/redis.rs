//! Guarded writes to Redis (feature `redis`): a value set only if the write's token is
//! not below the one stored for it, checked and written by one script.
//!
//! Each key written through [`set`] or [`set_fields`] has a fence key beside it
//! ([`fence_key`]) holding the largest token that wrote it. The script compares, and
//! either writes the value and the token or writes nothing and answers the stored token
//! ([`FenceError::Stale`]). Tokens are compared as decimal strings (length, then digits),
//! so every `u64` compares exactly; Lua's numbers are never involved.
//!
//! Works over any redis-rs async connection: a `MultiplexedConnection`, a
//! `ConnectionManager`, a cluster connection (the fence key shares the value's hash slot,
//! see [`fence_key`]).
//!
//! ```no_run
//! use tower_redlock::fence::{self, FenceError};
//! use tower_redlock::Redlock;
//!
//! # async fn run(locker: Redlock, client: redis::Client) -> Result<(), Box<dyn std::error::Error>> {
//! let mut conn = client.get_multiplexed_async_connection().await?;
//! let lease = locker.try_acquire("order:42").await?;
//! match fence::redis::set(&mut conn, &lease, "order:42:status", "paid").await {
//!     Ok(()) => {}
//!     Err(FenceError::Stale { current, .. }) => {
//!         // A later holder (token `current`) wrote: this lease is over, nothing written.
//!         # let _ = current;
//!     }
//!     Err(other) => return Err(other.into()),
//! }
//! fence::redis::set_fields(&mut conn, &lease, "order:42", &[("status", "paid"), ("by", "worker-1")])
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! The write's token is the holder's ([`Fenced`]): a lease's
//! [`fencing_token`](crate::LeaseHandle::fencing_token); for another member of a set,
//! pass `&(member, lease.fencing_token_of(&member)?)`. A holder that is not exclusive
//! is refused with [`FenceError::NotExclusive`] before anything is sent (see
//! [Writers only](super#writers-only)).
//!
//! The fence key has no expiry: it must live as long as the value it guards. Delete the
//! two together (a fence deleted alone lets an old token write again).

use std::sync::LazyLock;

use redis::aio::ConnectionLike;

use super::{writer_tokens, FenceError, Fenced};
use crate::node::redis::call::{Call, Lua};
use crate::node::redis::conn::Any;
use crate::FencingToken;

/// KEYS: the value's key, its fence key. ARGV: the token (decimal), `string` or `hash`,
/// then the value, or the hash's field/value pairs. Answers `{1}` when written, `{0,
/// stored}` when refused.
const GUARDED_SET: &str = r#"
local token = ARGV[1]
local stored = redis.call('GET', KEYS[2])
if stored then
    -- Decimal strings without leading zeros: the longer is larger, else compare digits.
    if #stored > #token or (#stored == #token and stored > token) then
        return {'0', stored}
    end
end
if ARGV[2] == 'string' then
    redis.call('SET', KEYS[1], ARGV[3])
else
    redis.call('HSET', KEYS[1], unpack(ARGV, 3))
end
redis.call('SET', KEYS[2], token)
return {'1'}
"#;

/// Sent by hash, as the lock scripts are (see `Call` on command order): a write
/// overtaken by a later one sent while it met `NOSCRIPT` is still judged by its token.
static SCRIPT: LazyLock<Lua> = LazyLock::new(|| Lua::new(GUARDED_SET));

/// The key holding `key`'s fence: in the same Redis Cluster hash slot as `key`.
///
/// A key with a hash tag (`{…}`, non-empty) keeps it: `key:fence`. Any other key
/// becomes the tag: `{key}:fence`. A key without a tag that contains `}` cannot be made
/// a tag; its fence is `key:fence` too, fine on one server, refused by a cluster as
/// `CROSSSLOT`: give such keys a hash tag.
///
/// ```
/// use tower_redlock::fence::redis::fence_key;
///
/// assert_eq!(fence_key("order:42"), "{order:42}:fence");
/// assert_eq!(fence_key("{order:42}:status"), "{order:42}:status:fence");
/// ```
pub fn fence_key(key: &str) -> String {
    // A key with a hash tag has a `}`; any key with one stays as it is.
    if key.contains('}') {
        format!("{key}:fence")
    } else {
        format!("{{{key}}}:fence")
    }
}

/// Sets the string `key` to `value` if `held`'s token is not below the token stored for
/// `key` (the token is stored with it), else [`FenceError::Stale`] and nothing written.
pub async fn set<C: ConnectionLike + Send>(
    conn: &mut C,
    held: &(impl Fenced + ?Sized),
    key: &str,
    value: impl redis::ToRedisArgs + Send + Sync,
) -> Result<(), FenceError<redis::RedisError>> {
    write(conn, held, key, |call| call.arg("string").arg(value)).await
}

/// Sets `fields` of the hash `key` if `held`'s token is not below the token stored for
/// `key`, else [`FenceError::Stale`] and nothing written. Other fields are kept.
pub async fn set_fields<C, F, V>(
    conn: &mut C,
    held: &(impl Fenced + ?Sized),
    key: &str,
    fields: &[(F, V)],
) -> Result<(), FenceError<redis::RedisError>>
where
    C: ConnectionLike + Send,
    F: redis::ToRedisArgs + Send + Sync,
    V: redis::ToRedisArgs + Send + Sync,
{
    if fields.is_empty() {
        return Err(client_error(
            "a guarded hash write needs at least one field",
        ));
    }
    write(conn, held, key, |mut call| {
        call = call.arg("hash");
        for (field, value) in fields {
            call = call.arg(field).arg(value);
        }
        call
    })
    .await
}

fn client_error(what: &'static str) -> FenceError<redis::RedisError> {
    FenceError::Store(redis::RedisError::from((redis::ErrorKind::Client, what)))
}

/// The token stored for `key` (`None`: nothing has written it through a guard).
pub async fn current<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
) -> Result<Option<FencingToken>, redis::RedisError> {
    let stored: Option<u64> = redis::cmd("GET")
        .arg(fence_key(key))
        .query_async(conn)
        .await?;
    Ok(stored.map(FencingToken::new))
}

/// The guarded write of `key` on the application's connection, `args` adding the value
/// to the call: written, or refused as stale. The token is `held`'s first resource's,
/// as [`LeaseHandle::fencing_token`](crate::LeaseHandle::fencing_token).
async fn write<C: ConnectionLike + Send>(
    conn: &mut C,
    held: &(impl Fenced + ?Sized),
    key: &str,
    args: impl FnOnce(Call) -> Call,
) -> Result<(), FenceError<redis::RedisError>> {
    let Some(&(_, token)) = writer_tokens(held)?.first() else {
        return Err(client_error(
            "a guarded write needs a holder: it holds nothing",
        ));
    };
    let call = Call::new(&SCRIPT, 2).arg(key).arg(fence_key(key));
    let call = args(call.arg(token.get()));
    let value = call.run(&mut Any(conn), None, |_| false).await;
    let value = value.map_err(|e| FenceError::Store(e.into_redis_error()))?;
    let reply: Vec<String> =
        redis::from_redis_value(value).map_err(|e| FenceError::Store(e.into()))?;
    match reply.as_slice() {
        [written] if written == "1" => return Ok(()),
        [refused, stored] if refused == "0" => {
            if let Ok(current) = stored.parse::<u64>() {
                return Err(FenceError::Stale {
                    fence: key.to_owned(),
                    token,
                    current: FencingToken::new(current),
                });
            }
        }
        _ => {}
    }
    Err(FenceError::Store(redis::RedisError::from((
        redis::ErrorKind::Parse,
        "unexpected reply of the guarded write script",
        format!("key {key:?}: {reply:?} (is the fence key written by something else?)"),
    ))))
}
