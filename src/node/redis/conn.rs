//! The command connection of the standalone and Sentinel nodes: one redis-rs
//! `MultiplexedConnection` at a time, made on first use and made again when found
//! broken, plus one resend when a command finds it broken. The nodes use it through
//! `batching.rs`, which sends concurrent callers' commands together.
//!
//! # Why not redis-rs's `ConnectionManager`
//!
//! It does the same reconnecting, and every command paid for its generality: an
//! `ArcSwap` load, a clone of a shared future and a poll of it, on top of the
//! connection's own clone (3–4 % of the client's CPU time per acquire + release under
//! Tokio's current-thread runtime, `BENCHMARKS.md`). Here a command takes a lock held
//! only to clone the connection. The manager also handed the next caller the
//! outcome of its last attempt to connect, a refusal possibly from while the server
//! was still down; here a failed attempt is nobody's but its own callers'.
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

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use futures_util::future::{BoxFuture, FutureExt, Shared};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{
    AsyncConnectionConfig, Client, Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value,
};

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

/// An attempt to connect, shared by every caller that waits for it; it ends with the
/// connection and its number.
type Attempt = Shared<BoxFuture<'static, RedisResult<(MultiplexedConnection, u64)>>>;

enum State {
    /// No connection and no attempt: before the first command, and after the
    /// connection was found broken or an attempt failed. The next command makes an
    /// attempt, so a failure is never handed to a later caller (redis-rs's
    /// `ConnectionManager`, which this replaces, kept the outcome of its last attempt
    /// for the next caller, possibly a refusal from while the server was still down).
    Idle,
    Connecting {
        attempt: Attempt,
        number: u64,
    },
    /// Numbered, so that a failure seen on an older connection does not drop this one.
    Ready {
        conn: MultiplexedConnection,
        number: u64,
    },
}

impl Resending {
    /// A connection to `client`'s server with `config`, made on first use.
    pub(crate) fn new(client: Client, config: AsyncConnectionConfig) -> Self {
        Resending(Arc::new(Link {
            client,
            config,
            state: Mutex::new(State::Idle),
        }))
    }

    /// Sends `cmd`, and once more if the connection was found broken.
    pub(crate) async fn send(&self, cmd: &Cmd) -> RedisResult<Value> {
        let (mut conn, number) = self.connection().await?;
        match self.observe(number, conn.send_packed_command(cmd).await) {
            Err(e) if found_broken(&e) => {
                tracing::debug!(error = %e, "connection found broken: sending again");
                let (mut conn, number) = self.connection().await?;
                self.observe(number, conn.send_packed_command(cmd).await)
            }
            other => other,
        }
    }

    /// Sends `count` commands of `pipeline` from `offset`, and once more if the
    /// connection was found broken.
    pub(crate) async fn send_many(
        &self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let (mut conn, number) = self.connection().await?;
        let sent = conn.send_packed_commands(pipeline, offset, count).await;
        match self.observe(number, sent) {
            Err(e) if found_broken(&e) => {
                tracing::debug!(error = %e, "connection found broken: sending again");
                let (mut conn, number) = self.connection().await?;
                let sent = conn.send_packed_commands(pipeline, offset, count).await;
                self.observe(number, sent)
            }
            other => other,
        }
    }

    /// The connection and its number: the current one, or the one an attempt (this
    /// caller's or an earlier caller's) makes. A failed attempt's error is the
    /// caller's; as a connection found broken, it is resent once, on a new attempt.
    async fn connection(&self) -> RedisResult<(MultiplexedConnection, u64)> {
        let attempt = {
            let mut state = self.0.lock();
            match &*state {
                State::Ready { conn, number } => return Ok((conn.clone(), *number)),
                State::Connecting { attempt, .. } => attempt.clone(),
                State::Idle => self.0.start(&mut state),
            }
        };
        attempt.await
    }

    /// Passes `outcome` on, first dropping connection `number` if the error says it is
    /// of no further use (redis-rs's `is_unrecoverable_error`: dropped, or a reply it
    /// could not parse), so that the next command makes a new one.
    fn observe<T>(&self, number: u64, outcome: RedisResult<T>) -> RedisResult<T> {
        if let Err(e) = &outcome {
            if e.is_unrecoverable_error() {
                let mut state = self.0.lock();
                if matches!(&*state, State::Ready { number: current, .. } if *current == number) {
                    *state = State::Idle;
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

impl Link {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts an attempt to connect (`state` is this link's, locked and idle), in a
    /// task of its own where there is a runtime: it completes, and leaves its
    /// connection for the next caller, even when every caller waiting for it gave up
    /// (their per-node timeout is shorter than the attempt's).
    fn start(self: &Arc<Self>, state: &mut State) -> Attempt {
        let number = NEXT_NUMBER.fetch_add(1, Ordering::Relaxed);
        let link = Arc::downgrade(self);
        let (client, config) = (self.client.clone(), self.config.clone());
        let attempt = connect(link, client, config, number).boxed().shared();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(attempt.clone().map(drop));
        }
        *state = State::Connecting {
            attempt: attempt.clone(),
            number,
        };
        attempt
    }
}

/// Numbers connections, in every link of the process: unique is all they need be.
static NEXT_NUMBER: AtomicU64 = AtomicU64::new(1);

/// Attempt `number`: connects, and makes the outcome the link's state (the connection,
/// or idle after a failure) unless the link moved on meanwhile.
async fn connect(
    link: Weak<Link>,
    client: Client,
    config: AsyncConnectionConfig,
    number: u64,
) -> RedisResult<(MultiplexedConnection, u64)> {
    let outcome = client
        .get_multiplexed_async_connection_with_config(&config)
        .await;
    if let Some(link) = link.upgrade() {
        let mut state = link.lock();
        if matches!(&*state, State::Connecting { number: current, .. } if *current == number) {
            *state = match &outcome {
                Ok(conn) => State::Ready {
                    conn: conn.clone(),
                    number,
                },
                Err(_) => State::Idle,
            };
        }
    }
    outcome.map(|conn| (conn, number))
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

impl SendOne for Resending {
    async fn send_one(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        self.send(cmd).await?.extract_error()
    }

    async fn send_pipeline(&mut self, pipe: &Pipeline) -> RedisResult<Vec<RedisResult<Value>>> {
        Ok(one_result_each(self.send_many(pipe, 0, pipe.len()).await?))
    }
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

impl ConnectionLike for Resending {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.send(cmd))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(self.send_many(pipeline, offset, count))
    }

    fn get_db(&self) -> i64 {
        self.db()
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
