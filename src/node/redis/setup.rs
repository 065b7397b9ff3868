//! [`Node::server_setup`](crate::node::Node::server_setup) of the Redis nodes: the role and
//! eviction policy from `INFO` (readable where managed services disable `CONFIG`), and
//! what the connection's user is allowed, learnt by running the commands the locker
//! needs on keys and a channel no lease uses (`ACL DRYRUN` would need admin rights).

use redis::aio::ConnectionLike;
use redis::{RedisError, Value};

use crate::error::NodeError;
use crate::node::redis::call::node_error;
use crate::node::{parse_info, ResourceKeys, ServerSetup};

/// The SHA1 of no script the crate loads: `EVALSHA` answers `NOSCRIPT` when the user may
/// run it on the probe key, and `NOPERM` when not.
const UNKNOWN_SHA: &str = "0000000000000000000000000000000000000000";

/// Whether Redis refused `error` for the user's ACL.
fn refused(error: &RedisError) -> bool {
    error.code() == Some("NOPERM")
}

/// `INFO <section>`, or `None` when the user may not run it (nothing is known then).
async fn info<C: ConnectionLike + Send>(
    conn: &mut C,
    section: &str,
) -> Result<Option<String>, NodeError> {
    match redis::cmd("INFO")
        .arg(section)
        .query_async::<String>(conn)
        .await
    {
        Ok(text) => Ok(Some(text)),
        Err(error) if refused(&error) => Ok(None),
        Err(error) => Err(node_error(error)),
    }
}

/// The role, eviction policy and persistence of the server behind `conn`.
pub(crate) async fn read_info<C: ConnectionLike + Send>(
    conn: &mut C,
    server: &str,
) -> Result<ServerSetup, NodeError> {
    let memory = info(conn, "memory").await?.unwrap_or_default();
    let replication = info(conn, "replication").await?.unwrap_or_default();
    let persistence = info(conn, "persistence").await?.unwrap_or_default();
    let mut setup = parse_info(server, &format!("{memory}\n{replication}\n{persistence}"));
    if setup.persists.is_none() && persistence.contains("aof_enabled:0") {
        // Without AOF, RDB snapshots are the `save` schedule; a managed service may
        // refuse `CONFIG` (unknown then).
        let save: Result<Vec<String>, RedisError> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("save")
            .query_async(conn)
            .await;
        if let Ok([_, schedule]) = save.as_deref() {
            setup.persists = Some(!schedule.trim().is_empty());
        }
    }
    Ok(setup)
}

/// Every command the locker sends, itself or from its scripts, but `WAIT` (only for
/// replica acknowledgements) and `INFO` (optional).
const NEEDED: &str = "evalsha eval set get exists del pttl pexpire incr type time hget hset \
                      hsetnx hmget zadd zcard zpopmin zrange zrem zremrangebyscore zscore";

/// [`NEEDED`] and the channels' commands (`sharded`: a Cluster's).
fn needed(sharded: bool) -> impl Iterator<Item = &'static str> {
    let channels = if sharded {
        "spublish ssubscribe sunsubscribe"
    } else {
        "publish subscribe unsubscribe"
    };
    NEEDED.split_whitespace().chain(channels.split(' '))
}

/// Adds to `setup` the commands the locker needs that the server lacks (renamed or
/// removed with `rename-command`, as managed services and hardening guides do; scripts
/// cannot call them either): `COMMAND INFO` answers nil for them. Nothing is known
/// when the user may not run `COMMAND`.
async fn probe_commands<C: ConnectionLike + Send>(
    conn: &mut C,
    sharded: bool,
    setup: &mut ServerSetup,
) -> Result<(), NodeError> {
    let mut info = redis::cmd("COMMAND");
    info.arg("INFO");
    for command in needed(sharded) {
        info.arg(command);
    }
    match info.query_async::<Vec<Value>>(conn).await {
        Ok(found) => {
            let absent = needed(sharded).zip(found).filter(|(_, v)| *v == Value::Nil);
            setup
                .missing
                .extend(absent.map(|(command, _)| command.to_uppercase()));
            Ok(())
        }
        Err(error) if refused(&error) || unknown_command(&error) => Ok(()),
        Err(error) => Err(node_error(error)),
    }
}

/// Whether the server does not know the command of `error` (renamed or removed).
fn unknown_command(error: &RedisError) -> bool {
    error
        .detail()
        .is_some_and(|detail| detail.starts_with("unknown command"))
}

/// Adds to `setup` the commands the server lacks (see [`probe_commands`]) and what the
/// user behind `conn` is refused: the scripts on the lock keys (`EVALSHA`, and `EVAL`,
/// which runs a script the server lost), and publishing on the wake-up channels. Writes
/// nothing: the scripts are not run, and nobody listens on the probe's channel.
pub(crate) async fn probe_permissions<C: ConnectionLike + Send>(
    conn: &mut C,
    probe: &ResourceKeys,
    sharded: bool,
    setup: &mut ServerSetup,
) -> Result<(), NodeError> {
    probe_commands(conn, sharded, setup).await?;
    if !setup.missing.is_empty() {
        // The probes below would fail on them; the refusal names them already.
        return Ok(());
    }
    let mut evalsha = redis::cmd("EVALSHA");
    evalsha.arg(UNKNOWN_SHA).arg(1).arg(&probe.lock);
    let mut eval = redis::cmd("EVAL");
    eval.arg("return 0").arg(1).arg(&probe.lock);
    let mut publish = redis::cmd("PUBLISH");
    publish.arg(&probe.channel).arg("");
    for (name, cmd) in [("EVALSHA", evalsha), ("EVAL", eval), ("PUBLISH", publish)] {
        let Err(error) = cmd.query_async::<Value>(conn).await else {
            continue;
        };
        if unknown_command(&error) {
            setup.missing.push(name.into());
        } else if !refused(&error) {
            // `EVALSHA`'s `NOSCRIPT`: allowed.
            if name != "EVALSHA" {
                return Err(node_error(error));
            }
        } else if name == "PUBLISH" {
            setup.channels_refused = true;
        } else {
            // The permission the refusal names: the lock keys' pattern (the prefix, then
            // the resource in braces), or the command.
            let permission = match error.detail().unwrap_or_default().contains("key") {
                true => format!("~{}*", probe.lock.split('{').next().unwrap_or_default()),
                false => format!("+{}", name.to_lowercase()),
            };
            if !setup.refused.contains(&permission) {
                setup.refused.push(permission);
            }
        }
    }
    Ok(())
}
