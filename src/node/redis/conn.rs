//! The command connection of the standalone and Sentinel nodes: one redis-rs
//! `MultiplexedConnection` at a time, made on first use and made again when found
//! broken, plus one resend when a command finds it broken. The nodes use it through
//! `batching.rs`, which sends concurrent callers' commands together.
//!
//! # Why not redis-rs's `ConnectionManager`
//!
//! It does the same reconnecting, and every command paid for its generality: an
//! `ArcSwap` load, a clone of a shared future and a poll of it, on top of the
//! connection's own clone (3–5 % of the client's CPU time per acquire + release under
//! Tokio's current-thread runtime, `BENCHMARKS.md`). Here a command takes a lock held
//! only to clone the connection. Two of its behaviours were wrong for a lock:
//!
//! * Commands that came while it (re)connected all awaited the attempt and went out in
//!   the order the scheduler woke them, not the order given: a waiter's leave could
//!   overtake the attempt that queued it and leave it queued. Here they are held in
//!   order and sent in one go when the connection is made (`Held`).
//! * It handed the next caller the outcome of its last attempt to connect, a refusal
//!   possibly from while the server was still down. Here a failed attempt fails only
//!   the commands that waited for it.
//!
//! # Why a resend
//!
//! A connection that died is found so only when used: a server restarted while the
//! locker was idle leaves a dead connection behind, and the next command fails on it
//! (`broken pipe`). Without a resend that first command (an acquisition, on every
//! restarted node at once) fails although the servers are up again. So a command
//! that fails because the connection is broken is sent once more, on a new
//! connection; the locker's per-node timeout bounds both sends together. A refused
//! connection is resent too (one more attempt to connect): the server may have come
//! up since the attempt the command waited for began.
//!
//! # Why resending is safe
//!
//! A broken connection does not say whether the server ran the command before the
//! connection died, so a resend may run it twice. Every command sent over this
//! connection tolerates that, because each checks the owner value that only this
//! acquisition knows:
//!
//! * **acquire** (`SET key owner NX PX` pipelined with the fence script, or the
//!   acquire script doing both; one `SET NX PX` without fencing): a second run finds
//!   the key holding its own owner value, which is the same grant, not a second one
//!   (see `acquire_fast.lua` and `Acquire::Pipelined`): nobody else can have been
//!   granted the key in between, since it held our value all along. The extra counter
//!   step only makes later tokens larger, which fencing allows.
//! * **extend** (compare-and-`PEXPIRE`) and **raise fence** (`if cur < t then set t`)
//!   reach the same state however often they run. A second extend counts the ttl from
//!   a later moment, so the key lives a little longer than the validity the locker
//!   computed from the round's start: the safe direction.
//! * **release** (compare-and-delete) and **record discard** (compare-and-delete of our
//!   token's marker): a second run finds nothing left and answers "not deleted"; the
//!   effect is the same, only the answer understates it.
//! * **record claim**: a second run finds our own pending marker and answers "claimed"
//!   again. **record store**: a second run finds the very record it stored (same
//!   token, fingerprint and data) and answers "stored" again; any other record with
//!   an equal or larger token still answers "superseded".
//! * reads (`GET`, `PTTL`, `HMGET`) have no effect.
//!
//! Anything that is not a broken connection (a server error, a timeout, failed
//! authentication) is not resent: the server may still be busy with the first send,
//! or will refuse the second one alike.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Waker};

use futures_util::stream::{FuturesUnordered, StreamExt};
use redis::aio::{ConnectionLike, MultiplexedConnection};
#[cfg(feature = "cluster")]
use redis::cluster_async::ClusterConnection;
use redis::{
    AsyncConnectionConfig, Client, Cmd, ErrorKind, Pipeline, RedisError, RedisResult, Value,
};
use tokio::sync::oneshot;

/// A node's command connection: multiplexed, cheap to clone (every clone shares the
/// connection), made on first use, made again after it was found broken, and resending
/// once a command that failed on a broken connection (see the module docs for why that
/// is safe for every command the nodes send).
#[derive(Clone)]
pub(crate) struct Resending(Arc<Link>);

/// What the clones of a [`Resending`] share.
struct Link {
    client: Client,
    config: AsyncConnectionConfig,
    state: Mutex<State>,
}

struct State {
    connection: Connection,
    /// Commands given while no connection was ready, in the order given. They go out in
    /// that order, all at once, as soon as one is (see [`Held`]).
    held: VecDeque<Held>,
    /// The place of the next command held.
    next_place: u64,
}

enum Connection {
    /// No connection and no attempt: before the first command, and after the
    /// connection was found broken or an attempt failed. The next command makes an
    /// attempt, so a failure is never handed to a later caller (keeping an attempt's
    /// outcome for the next caller, as redis-rs's `ConnectionManager` does, can hand it
    /// a refusal from while the server was still down).
    Idle,
    /// An attempt, in a task of its own, numbered as the connection it makes.
    Connecting(u64),
    /// Numbered, so that a failure seen on an older connection does not drop this one.
    Ready {
        conn: MultiplexedConnection,
        number: u64,
    },
}

/// A command given while no connection was ready: a new node's first commands, and
/// those that come while it reconnects. Held in order and sent in that order, in one
/// go, when the connection is made (or failed with its error when it cannot be), so
/// that they reach the server in the order given, as on a connection already made.
/// Woken together to send each its own, they would go in the order the scheduler runs
/// them: a waiter's leave could overtake the attempt that queued it, and leave it
/// queued.
struct Held {
    place: u64,
    commands: Commands,
    reply: oneshot::Sender<Outcome>,
}

/// A send's outcome, with the number of the connection it went out on (for
/// [`Resending::observe`]).
type Outcome = (RedisResult<Replies>, u64);

/// What one send carries: a command, or commands of a pipeline (`offset`, `count`).
enum Given<'a> {
    One(&'a Cmd),
    Many(&'a Pipeline, usize, usize),
}

/// [`Given`], owned, for a command held.
enum Commands {
    One(Cmd),
    Many(Pipeline, usize, usize),
}

/// One caller's replies, in the shape of its commands (here and in `batching.rs`).
pub(crate) enum Replies {
    One(Value),
    Many(Vec<Value>),
}

impl Replies {
    pub(crate) fn one(self) -> Value {
        match self {
            Replies::One(value) => value,
            Replies::Many(mut values) => values.pop().unwrap_or(Value::Nil),
        }
    }

    pub(crate) fn many(self) -> Vec<Value> {
        match self {
            Replies::One(value) => vec![value],
            Replies::Many(values) => values,
        }
    }
}

impl Given<'_> {
    async fn send(&self, conn: &mut MultiplexedConnection) -> RedisResult<Replies> {
        match *self {
            Given::One(cmd) => conn.send_packed_command(cmd).await.map(Replies::One),
            Given::Many(pipeline, offset, count) => conn
                .send_packed_commands(pipeline, offset, count)
                .await
                .map(Replies::Many),
        }
    }

    fn to_owned(&self) -> Commands {
        match *self {
            Given::One(cmd) => Commands::One(cmd.clone()),
            Given::Many(pipeline, offset, count) => Commands::Many(pipeline.clone(), offset, count),
        }
    }
}

impl Commands {
    fn given(&self) -> Given<'_> {
        match self {
            Commands::One(cmd) => Given::One(cmd),
            Commands::Many(pipeline, offset, count) => Given::Many(pipeline, *offset, *count),
        }
    }
}

impl Resending {
    /// A connection to `client`'s server with `config`, made on first use.
    pub(crate) fn new(client: Client, config: AsyncConnectionConfig) -> Self {
        Resending(Arc::new(Link {
            client,
            config,
            state: Mutex::new(State {
                connection: Connection::Idle,
                held: VecDeque::new(),
                next_place: 0,
            }),
        }))
    }

    /// Sends `cmd`, and once more if the connection was found broken.
    pub(crate) async fn send(&self, cmd: &Cmd) -> RedisResult<Value> {
        Ok(self.send_resending(Given::One(cmd)).await?.one())
    }

    /// Sends `count` commands of `pipeline` from `offset`, and once more if the
    /// connection was found broken.
    pub(crate) async fn send_many(
        &self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let replies = self.send_resending(Given::Many(pipeline, offset, count));
        Ok(replies.await?.many())
    }

    /// [`send`](Self::send), the reply's error as the `Err` (as [`SendOne::send_one`]).
    pub(crate) async fn send_one(&self, cmd: &Cmd) -> RedisResult<Value> {
        self.send(cmd).await?.extract_error()
    }

    /// Every command of `pipe`, one result each (as [`SendOne::send_pipeline`]).
    pub(crate) async fn send_pipeline(
        &self,
        pipe: &Pipeline,
    ) -> RedisResult<Vec<RedisResult<Value>>> {
        Ok(one_result_each(self.send_many(pipe, 0, pipe.len()).await?))
    }

    async fn send_resending(&self, given: Given<'_>) -> RedisResult<Replies> {
        match self.send_once(&given).await {
            Err(e) if found_broken(&e) => {
                tracing::debug!(error = %e, "connection found broken: sending again");
                self.send_once(&given).await
            }
            other => other,
        }
    }

    /// Sends `given` on the connection if one is ready and nothing is held, else holds
    /// it until one is (see [`Held`]); then passes the outcome to
    /// [`observe`](Self::observe).
    async fn send_once(&self, given: &Given<'_>) -> RedisResult<Replies> {
        let (outcome, number) = match self.0.ready_or_hold(given) {
            Ok((mut conn, number)) => (given.send(&mut conn).await, number),
            Err(held) => held.replies().await,
        };
        self.observe(number, outcome)
    }

    /// Passes `outcome` on, first dropping connection `number` if the error says it is
    /// of no further use (redis-rs's `is_unrecoverable_error`: dropped, or a reply it
    /// could not parse), so that the next command makes a new one.
    fn observe<T>(&self, number: u64, outcome: RedisResult<T>) -> RedisResult<T> {
        if let Err(e) = &outcome {
            if e.is_unrecoverable_error() {
                let mut state = self.0.lock();
                if matches!(&state.connection, Connection::Ready { number: current, .. } if *current == number)
                {
                    state.connection = Connection::Idle;
                }
            }
        }
        outcome
    }

    /// The database the connection selects.
    pub(crate) fn db(&self) -> i64 {
        self.0.client.get_connection_info().redis_settings().db()
    }
}

/// A caller's command held (see [`Held`]); dropped before it was sent, it takes the
/// command back: it is never sent, as redis-rs never sends a command dropped before it
/// took it.
struct HeldPlace<'a> {
    link: &'a Link,
    place: u64,
    reply: oneshot::Receiver<Outcome>,
}

impl HeldPlace<'_> {
    async fn replies(mut self) -> Outcome {
        match (&mut self.reply).await {
            Ok(replied) => replied,
            // Its sender went without a word: only a send dropped with the runtime.
            Err(_) => (Err(internal(PART, "the command's send was dropped")), 0),
        }
    }
}

impl Drop for HeldPlace<'_> {
    fn drop(&mut self) {
        let mut state = self.link.lock();
        if let Some(at) = state.held.iter().position(|h| h.place == self.place) {
            state.held.remove(at);
        }
    }
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The connection and its number if one is ready and no command is held; else
    /// `given` held, an attempt to connect under way.
    fn ready_or_hold(
        self: &Arc<Self>,
        given: &Given<'_>,
    ) -> Result<(MultiplexedConnection, u64), HeldPlace<'_>> {
        let mut state = self.lock();
        if let Connection::Ready { conn, number } = &state.connection {
            if state.held.is_empty() {
                return Ok((conn.clone(), *number));
            }
        }
        let (sender, reply) = oneshot::channel();
        let place = state.next_place;
        state.next_place += 1;
        state.held.push_back(Held {
            place,
            commands: given.to_owned(),
            reply: sender,
        });
        if matches!(state.connection, Connection::Idle) {
            self.start(&mut state);
        }
        Err(HeldPlace {
            link: self,
            place,
            reply,
        })
    }

    /// Starts an attempt to connect (`state` is this link's, locked, idle), in a task
    /// of its own: it completes, and leaves its connection for the next caller, even
    /// when every caller waiting for it gave up (their per-node timeout is shorter
    /// than the attempt's). Outside a runtime (none to connect on) the commands held
    /// fail.
    fn start(self: &Arc<Self>, state: &mut State) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            let error = internal(PART, "no Tokio runtime to connect on");
            flush_held(state, Err(error), 0);
            return;
        };
        let number = NEXT_NUMBER.fetch_add(1, Ordering::Relaxed);
        state.connection = Connection::Connecting(number);
        let link = Arc::downgrade(self);
        let (client, config) = (self.client.clone(), self.config.clone());
        runtime.spawn(connect(link, client, config, number));
    }
}

/// Numbers connections, in every link of the process: unique is all they need be.
static NEXT_NUMBER: AtomicU64 = AtomicU64::new(1);

/// Attempt `number`: connects, and makes the outcome the link's state (the connection,
/// or idle after a failure), sending the commands held on it or failing them with the
/// attempt's error.
async fn connect(link: Weak<Link>, client: Client, config: AsyncConnectionConfig, number: u64) {
    let outcome = client
        .get_multiplexed_async_connection_with_config(&config)
        .await;
    let Some(link) = link.upgrade() else {
        return;
    };
    let mut state = link.lock();
    if !matches!(state.connection, Connection::Connecting(current) if current == number) {
        return;
    }
    match outcome {
        Ok(conn) => {
            flush_held(&mut state, Ok(&conn), number);
            state.connection = Connection::Ready { conn, number };
        }
        Err(e) => {
            tracing::debug!(error = %e, "cannot connect");
            flush_held(&mut state, Err(e), number);
            state.connection = Connection::Idle;
        }
    }
}

/// Sends every command held on `conn`, in the order given: each is handed to redis-rs
/// here (a send takes its command at its first poll), and one task awaits the replies
/// and passes each on. With an error instead, each held command fails with it.
fn flush_held(state: &mut State, conn: RedisResult<&MultiplexedConnection>, number: u64) {
    let held = std::mem::take(&mut state.held);
    let conn = match conn {
        Ok(conn) => conn,
        Err(e) => {
            for one in held {
                let _ = one.reply.send((Err(e.clone()), number));
            }
            return;
        }
    };
    let mut sending = FuturesUnordered::new();
    for one in held {
        let mut conn = conn.clone();
        let mut send = Box::pin(async move {
            let replies = one.commands.given().send(&mut conn).await;
            let _ = one.reply.send((replies, number));
        });
        // The first poll hands the command over; its reply is awaited below.
        if send
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_pending()
        {
            sending.push(send);
        }
    }
    if !sending.is_empty() {
        tokio::spawn(async move { while sending.next().await.is_some() {} });
    }
}

/// How this module's own errors name it.
const PART: &str = "node connection";

/// An error of the client's own making (not the server's, not the network's): `part`
/// names the piece of the node that found it.
pub(crate) fn internal(part: &'static str, what: &'static str) -> RedisError {
    RedisError::from((ErrorKind::Client, part, what.to_owned()))
}

/// The connection was found broken or could not be made: the next command (the
/// resend) makes a new one.
fn found_broken(e: &RedisError) -> bool {
    // `is_connection_dropped` covers a reset, aborted or closed connection and a
    // refusal; a timeout is not one of them.
    e.is_connection_dropped() && !e.is_timeout()
}

/// A connection that sends one command, or one pipeline, as `query_async` does,
/// without boxing the call where the connection allows it: `ConnectionLike` boxes
/// every call, and every lock call is one command or one pipeline.
pub(crate) trait SendOne: ConnectionLike + Send {
    /// The reply to `cmd`, as a `Value` (the reply's errors become the `Err`).
    fn send_one<'a>(
        &'a mut self,
        cmd: &'a Cmd,
    ) -> impl Future<Output = RedisResult<Value>> + Send + 'a;

    /// The replies to every command of `pipe`, which ignores errors (`ignore_errors`)
    /// and no command of which is ignored: one result per command, a server error as
    /// its `Err`, as `query_async::<Vec<RedisResult<Value>>>` gives them.
    fn send_pipeline<'a>(
        &'a mut self,
        pipe: &'a Pipeline,
    ) -> impl Future<Output = RedisResult<Vec<RedisResult<Value>>>> + Send + 'a;
}

/// A pipeline's replies as `send_pipeline` gives them: a server error as its `Err`.
pub(crate) fn one_result_each(replies: Vec<Value>) -> Vec<RedisResult<Value>> {
    replies
        .into_iter()
        .map(|reply| match reply {
            Value::ServerError(error) => Err(error.into()),
            reply => Ok(reply),
        })
        .collect()
}

#[cfg(feature = "cluster")]
impl SendOne for ClusterConnection {
    fn send_one<'a>(
        &'a mut self,
        cmd: &'a Cmd,
    ) -> impl Future<Output = RedisResult<Value>> + Send + 'a {
        cmd.query_async(self)
    }

    fn send_pipeline<'a>(
        &'a mut self,
        pipe: &'a Pipeline,
    ) -> impl Future<Output = RedisResult<Vec<RedisResult<Value>>>> + Send + 'a {
        pipe.query_async(self)
    }
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;

    #[test]
    fn only_broken_connections_are_resent() {
        for kind in [
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::ConnectionAborted,
            io::ErrorKind::ConnectionRefused,
            io::ErrorKind::UnexpectedEof,
        ] {
            assert!(
                found_broken(&RedisError::from(io::Error::from(kind))),
                "{kind:?}"
            );
        }
        assert!(!found_broken(&RedisError::from(io::Error::from(
            io::ErrorKind::TimedOut
        ))));
        let oom = RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "OOM command not allowed",
        ));
        assert!(!found_broken(&oom));
        let auth = RedisError::from((redis::ErrorKind::AuthenticationFailed, "WRONGPASS"));
        assert!(!found_broken(&auth));
    }
}
