//! What every Redis-backed node shares: the Lua scripts, one script call with its
//! `NOSCRIPT` fallback and its optional replica acknowledgement (`WAIT`), and how
//! redis-rs errors become [`NodeError`]s.

use std::fmt;
use std::future::Future;
use std::sync::LazyLock;
use std::time::Duration;

use redis::{Cmd, ErrorKind, RedisError, RedisResult, Script, ServerErrorKind, Value};

use crate::error::NodeError;
use crate::node::redis::conn::SendOne;
use crate::node::redis::millis_ceil;
use crate::node::ResourceKeys;
use crate::node::{CHANNEL_SUFFIX, DEFAULT_FENCE_TTL, HANDOFF_TTL, QUEUE_SUFFIX};

/// One Lua script: its source (for `EVAL`), its SHA1 (for `EVALSHA`), and whether its
/// calls go by hash (see [`Call`] for when they may).
pub(crate) struct Lua {
    code: &'static str,
    script: Script,
    by_hash: bool,
}

impl Lua {
    pub(crate) fn new(code: &'static str) -> Self {
        Lua {
            code,
            script: Script::new(code),
            by_hash: true,
        }
    }
}

// The scripts, put together from `scripts/*.lua`: `held.lua` serves every one that
// compares a lock key with an owner value, `fence_rule.lua` every one that touches a
// fence counter (the rule lives there alone), `hand_off.lua` those that hand a free lock
// to the next waiter. The acquire and release scripts' fast path (one resource, a caller
// that does not wait, nobody queued) returns before any of the queue's functions is
// built, the release's before any function at all: Redis charges per argument, per
// `redis.call` and per Lua closure made (BENCHMARKS.md).

/// A [`Lua`] put together from `scripts/*.lua`, in the order named.
macro_rules! lua {
    ($($file:literal),+) => {
        LazyLock::new(|| Lua::new(concat!($(include_str!(concat!("../scripts/", $file, ".lua"))),+)))
    };
}

/// Every acquisition: one resource or a set, exclusive or shared (`acquire.lua`).
pub(crate) static ACQUIRE: LazyLock<Lua> = lua!(
    "held",
    "fence_rule",
    "acquire",
    "hand_off",
    "acquire_queued"
);
/// The fence counter's rule alone, pipelined behind a plain `SET NX PX` (see
/// [`Acquire::Pipelined`]).
static FENCE: LazyLock<Lua> = lua!("fence_rule", "fence");
static EXTEND: LazyLock<Lua> = lua!("held", "extend");
static RELEASE: LazyLock<Lua> = lua!("release", "held", "hand_off", "release_queued");
static RAISE_FENCES: LazyLock<Lua> = lua!("fence_rule", "raise_fences");
static LISTEN: LazyLock<Lua> = lua!("listen");
/// The outcome records' claim, store and discard (`records.rs`): always `EVAL`, in the
/// order they were made (see [`Call`]).
pub(crate) static RECORD: LazyLock<Lua> = LazyLock::new(|| Lua {
    by_hash: false,
    ..Lua::new(concat!(
        include_str!("../scripts/held.lua"),
        include_str!("../scripts/record.lua")
    ))
});

/// Replica acknowledgement: after a script wrote, `WAIT replicas timeout` on the same
/// connection, and the answer counts only if at least `replicas` replicas acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplicaWait {
    pub(crate) replicas: usize,
    pub(crate) timeout: Duration,
}

/// The longest `WAIT` sent: the locker cuts every call at its node timeout (shorter than
/// the ttl, at most 30 days) anyway, and Redis refuses a timeout past its clock's range.
const MAX_WAIT_MS: u64 = 30 * 24 * 3600 * 1000;

impl ReplicaWait {
    /// The timeout as `WAIT` takes it: from 1 ms (0 would block until enough replicas
    /// acknowledged, however long) to [`MAX_WAIT_MS`].
    fn timeout_ms(&self) -> u64 {
        millis_ceil(self.timeout).clamp(1, MAX_WAIT_MS)
    }
}

impl fmt::Display for ReplicaWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "wait for {} replica(s) within {} ms",
            self.replicas,
            self.timeout_ms()
        )
    }
}

/// The text of a node error without its kind's prefix.
#[cfg(any(feature = "cluster", feature = "sentinel"))]
pub(crate) fn detail(e: &NodeError) -> std::sync::Arc<str> {
    match e {
        NodeError::Connection(m) | NodeError::Server(m) | NodeError::Protocol(m) => m.clone(),
        other => other.to_string().into(),
    }
}

/// Why one script call failed.
#[derive(Debug)]
pub(crate) enum CallError {
    /// The connection or the server failed.
    Redis(RedisError),
    /// The script wrote, but fewer replicas than required acknowledged it in time.
    Replicas { acked: i64, wait: ReplicaWait },
    /// The answer had an unexpected shape.
    Reply(NodeError),
}

impl From<RedisError> for CallError {
    fn from(e: RedisError) -> Self {
        CallError::Redis(e)
    }
}

impl CallError {
    /// The server that answered may no longer be the master (it is unreachable, it
    /// answers as a replica, or it lost its replicas): ask the sentinels again.
    #[cfg(feature = "sentinel")]
    pub(crate) fn master_may_have_moved(&self) -> bool {
        match self {
            CallError::Redis(e) => is_connection_error(e) || refused_write(e),
            CallError::Replicas { .. } => true,
            CallError::Reply(_) => false,
        }
    }

    /// The script certainly did not run (the server refused every write, or no
    /// connection was made): the call may be sent again elsewhere without effect here.
    #[cfg(feature = "sentinel")]
    pub(crate) fn certainly_not_run(&self) -> bool {
        match self {
            CallError::Redis(e) => e.is_connection_refusal() || refused_write(e),
            _ => false,
        }
    }

    /// As a redis-rs error (for an application's own connection, `fence::redis`).
    pub(crate) fn into_redis_error(self) -> RedisError {
        match self {
            CallError::Redis(e) => e,
            other => RedisError::from((
                ErrorKind::Client,
                "script call",
                other.into_node_error().to_string(),
            )),
        }
    }

    pub(crate) fn into_node_error(self) -> NodeError {
        match self {
            CallError::Redis(e) => node_error(e),
            CallError::Replicas { acked, wait } => NodeError::Server(
                format!(
                    "the write was acknowledged by {acked} replica(s), {} required ({wait})",
                    wait.replicas
                )
                .into(),
            ),
            CallError::Reply(e) => e,
        }
    }
}

/// The server refused every write: a replica, or a master that lost its replicas.
#[cfg(feature = "sentinel")]
fn refused_write(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
    )
}

fn is_connection_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout()
}

/// A redis-rs error as a [`NodeError`]. Authentication failures and client-side
/// configuration or discovery failures count as connection failures (no usable
/// connection could be made) and keep their reason.
pub(crate) fn node_error(e: RedisError) -> NodeError {
    if is_connection_error(&e) {
        NodeError::Connection(e.to_string().into())
    } else if e.kind() == ErrorKind::AuthenticationFailed
        || matches!(e.kind(), ErrorKind::Server(ServerErrorKind::NoPerm))
        || e.code()
            .is_some_and(|code| code == "WRONGPASS" || code == "NOAUTH")
        // A server refuses a long command (the acquire script's) from a client that has
        // not authenticated with "Protocol error: unauthenticated multibulk length".
        || e.to_string().contains("unauthenticated")
    {
        NodeError::Connection(format!("authentication failed: {e}").into())
    } else if matches!(
        e.kind(),
        ErrorKind::InvalidClientConfig
            | ErrorKind::ClusterConnectionNotFound
            | ErrorKind::MasterNameNotFoundBySentinel
            | ErrorKind::NoValidReplicasFoundBySentinel
            | ErrorKind::EmptySentinelList
    ) {
        // Client-side: no usable connection to the right server could be made.
        NodeError::Connection(e.to_string().into())
    } else if matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension) {
        NodeError::Server(e.to_string().into())
    } else {
        NodeError::Protocol(e.to_string().into())
    }
}

/// A key made of a base and a suffix (the wait queue's `lock:queue`), written into the
/// command as one argument without a string of its own: it goes out on every call.
pub(crate) struct Suffixed<'a>(pub(crate) &'a str, pub(crate) &'static str);

impl redis::ToRedisArgs for Suffixed<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        let mut arg = out.writer_for_next_arg();
        // Writing into the command's buffer cannot fail.
        let _ = arg.write_all(self.0.as_bytes());
        let _ = arg.write_all(self.1.as_bytes());
    }
}

/// One prepared script call, the one way every script of the crate is sent (the Redis
/// nodes' operations and the guarded writes of `fence::redis`): the `EVALSHA` command,
/// built once with its keys and arguments (numbers are written straight into the
/// command, with no string of their own), and the `EVAL` form built from it.
///
/// # Command order
///
/// Commands sent on one connection run in the order they were sent. A call by hash
/// that meets `NOSCRIPT` (a server that has not seen the script yet: fresh, restarted,
/// a promoted replica) is sent again as `EVAL` one round trip later, behind whatever
/// was sent on that connection meanwhile: a later call may then run before it. That
/// is harmless unless a call whose effect depends on this one having run can be sent
/// while it is in flight, and where one can, the script goes out as `EVAL` every time
/// (`RECORD`), which costs the server a SHA1 of the script per call:
///
/// * the lock scripts go by hash: the engine sends no release of an attempt to a node
///   while that node's acquire call is in flight (a failed attempt releases on each
///   node only once that node's acquire call finished, retry included,
///   `Nodes::release_after`; a won lease's release waits for the acquire calls that
///   outlived the round; a cancelled attempt drops its calls, which are then never
///   resent), and an extend or a raise of the fence only follows its acquisition;
/// * the record scripts go in order: a claim decided before every node answered
///   leaves the other claims running while it discards its marker at once, and a
///   discard that overtook its claim would leave the marker behind (the key would
///   answer "outcome unknown" for nothing).
pub(crate) struct Call {
    lua: &'static Lua,
    evalsha: Cmd,
}

impl Call {
    /// `EVALSHA sha keys…`; add the keys first, then the arguments.
    pub(crate) fn new(lua: &'static Lua, keys: usize) -> Self {
        // Sized for the largest call (acquire: 3 keys of a few dozen bytes, 12
        // arguments), so that building it never reallocates.
        Self::with_capacity(lua, keys, 18, 384)
    }

    /// As [`new`](Self::new), for `args` words in all of `bytes` bytes.
    fn with_capacity(lua: &'static Lua, keys: usize, args: usize, bytes: usize) -> Self {
        let mut evalsha = Cmd::with_capacity(args, bytes);
        evalsha.arg("EVALSHA").arg(lua.script.get_hash()).arg(keys);
        Call { lua, evalsha }
    }

    pub(crate) fn arg<T: redis::ToRedisArgs>(mut self, arg: T) -> Self {
        self.evalsha.arg(arg);
        self
    }

    /// The same call as `EVAL code …`.
    fn eval(&self) -> Cmd {
        let mut eval = redis::cmd("EVAL");
        eval.arg(self.lua.code);
        for arg in self.evalsha.args_iter().skip(2) {
            if let redis::Arg::Simple(bytes) = arg {
                eval.arg(bytes);
            }
        }
        eval
    }

    /// Runs the script with `EVALSHA`, or with `EVAL` after `NOSCRIPT` (which also caches
    /// it on the server that answered: no `SCRIPT LOAD` on every node of a cluster); a
    /// script sent in order, with `EVAL` at once. With `wait`, `WAIT` is pipelined right
    /// behind it, and checked only when `wrote` says the script wrote.
    pub(crate) async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
        wrote: fn(&Value) -> bool,
    ) -> Result<Value, CallError> {
        if !self.lua.by_hash {
            return once(conn, &self.eval(), wait, wrote).await;
        }
        match once(conn, &self.evalsha, wait, wrote).await {
            Err(CallError::Redis(e))
                if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) =>
            {
                once(conn, &self.eval(), wait, wrote).await
            }
            other => other,
        }
    }
}

/// `cmd`, with `WAIT` pipelined behind it when `wait` is set, checked when `wrote` says
/// the command wrote.
pub(crate) async fn once<C: SendOne>(
    conn: &mut C,
    cmd: &Cmd,
    wait: Option<ReplicaWait>,
    wrote: fn(&Value) -> bool,
) -> Result<Value, CallError> {
    let Some(wait) = wait else {
        // One command, no pipeline: what nearly every call is.
        return Ok(conn.send_one(cmd).await?);
    };
    let mut pipe = redis::pipe();
    pipe.add_command(cmd.clone());
    // Boxed: a pipeline's send is 1.3 kB, and held inline it would enlarge every
    // call's future, nearly all of which never wait for replicas.
    let mut replies = Box::pin(query(conn, pipe, 1, Some(wait))).await?;
    let value = replies.remove(0)?;
    if wrote(&value) {
        check_acks(replies.pop(), Some(wait))?;
    }
    Ok(value)
}

/// Sends `pipe` (plus `WAIT` when `wait` is set) and returns one result per command
/// (`replies` of them; none may be marked ignored), the `WAIT` reply last.
pub(crate) async fn query<C: SendOne>(
    conn: &mut C,
    mut pipe: redis::Pipeline,
    replies: usize,
    wait: Option<ReplicaWait>,
) -> Result<Vec<RedisResult<Value>>, CallError> {
    let expected = replies + usize::from(wait.is_some());
    if let Some(wait) = wait {
        pipe.cmd("WAIT").arg(wait.replicas).arg(wait.timeout_ms());
    }
    pipe.ignore_errors();
    let replies = conn.send_pipeline(&pipe).await?;
    if replies.len() != expected {
        return Err(CallError::Reply(NodeError::Protocol(
            format!("{} replies to {expected} commands", replies.len()).into(),
        )));
    }
    Ok(replies)
}

/// Checks the `WAIT` reply (when `wait` is set) against the replicas required.
pub(crate) fn check_acks(
    reply: Option<RedisResult<Value>>,
    wait: Option<ReplicaWait>,
) -> Result<(), CallError> {
    let Some(wait) = wait else {
        return Ok(());
    };
    let reply =
        reply.ok_or_else(|| CallError::Reply(NodeError::Protocol("no reply to WAIT".into())))??;
    let acked = int(&reply).ok_or_else(|| {
        CallError::Reply(NodeError::Protocol(
            format!("WAIT returned {reply:?}").into(),
        ))
    })?;
    if acked < i64::try_from(wait.replicas).unwrap_or(i64::MAX) {
        return Err(CallError::Replicas { acked, wait });
    }
    Ok(())
}

/// One operation of a node: its commands, prepared when the node is called (so the
/// call's future owns them), and how its replies are read. Every Redis node kind runs
/// the same operations; they differ only in how a connection is reached (`node.rs`).
pub(crate) trait Op: Send + Sync + 'static {
    type Output: Send + 'static;

    /// Runs on `conn`. `wait` is the node's replica acknowledgement: operations whose
    /// writes a failover must keep pipeline `WAIT` behind them; the others ignore it.
    fn run<'a, C: SendOne>(
        &'a self,
        conn: &'a mut C,
        wait: Option<ReplicaWait>,
    ) -> impl Future<Output = Result<Self::Output, CallError>> + Send + 'a;
}

/// One script call as an operation, its reply read by `read`. With `wrote`, the node's
/// `WAIT` is checked when `wrote` says the script wrote; without, it never waits for
/// replicas (a lost release, mark or discard only delays someone until a key expires).
pub(crate) struct ScriptOp<T> {
    call: Call,
    wrote: Option<fn(&Value) -> bool>,
    read: fn(Value) -> Result<T, NodeError>,
}

impl<T> ScriptOp<T> {
    pub(crate) fn new(
        call: Call,
        wrote: Option<fn(&Value) -> bool>,
        read: fn(Value) -> Result<T, NodeError>,
    ) -> Self {
        ScriptOp { call, wrote, read }
    }
}

impl<T: Send + 'static> Op for ScriptOp<T> {
    type Output = T;

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<T, CallError> {
        let wrote = self.wrote.unwrap_or(|_| false);
        let value = self.call.run(conn, self.wrote.and(wait), wrote).await?;
        (self.read)(value).map_err(CallError::Reply)
    }
}

/// `what returned value`: a reply of an unexpected shape.
pub(crate) fn returned(what: &str, value: &Value) -> NodeError {
    NodeError::Protocol(format!("{what} returned {value:?}").into())
}

/// A `PTTL` in milliseconds as a duration (`None`: negative, no ttl).
pub(crate) fn pttl(value: &Value) -> Option<Duration> {
    int(value)
        .and_then(|ms| u64::try_from(ms).ok())
        .map(Duration::from_millis)
}

pub(crate) fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// The reply of the release and discard scripts: 1 or 0.
pub(crate) fn parse_flag(value: Value) -> Result<bool, NodeError> {
    match int(&value) {
        Some(1) => Ok(true),
        Some(0) => Ok(false),
        _ => Err(returned("script", &value)),
    }
}

mod acquire;
mod extend;
mod pipelined;
mod release;

pub(crate) use acquire::{raise_fences, Acquire};
pub(crate) use extend::ExtendCall;
pub(crate) use release::{listen, release, Hand};
