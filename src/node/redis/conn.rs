//! The command connection of the standalone and Sentinel nodes: one redis-rs
//! `MultiplexedConnection` at a time, made on first use and made again when found
//! broken, plus one resend when a command finds it broken. The nodes use it through
//! `batching/`, which sends concurrent callers' commands together.
//!
//! # Why not redis-rs's `ConnectionManager`
//!
//! Its generality cost every command (`BENCHMARKS.md`), it sent commands given while it
//! reconnected in the order the scheduler woke them, and it handed the next caller its
//! last attempt's refusal; [`Attempts`] (`attempt.rs`) does both otherwise.
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
//!   (see `acquire.lua` and `Acquire::Pipelined`): nobody else can have been
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
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::FutureExt;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Client, Cmd, Pipeline, RedisError, RedisResult, Value};

use crate::node::redis::attempt::{in_turn, Attempts};

/// A node's command connection: multiplexed, cheap to clone (every clone shares the
/// connection), made on first use, made again after it was found broken, and resending
/// once a command that failed on a broken connection (see the module docs for why that
/// is safe for every command the nodes send).
#[derive(Clone)]
pub(crate) struct Resending(Arc<Link>);

/// What the clones of a [`Resending`] share.
struct Link {
    client: Client,
    connection: Attempts<MultiplexedConnection, RedisError>,
}

impl Resending {
    /// A connection to `client`'s server, made on first use (call inside a Tokio runtime).
    pub(crate) fn new(client: Client) -> Self {
        // An attempt to connect outlives the callers' per-node timeout, so that a slow
        // network still gets a connection for the next caller; it is made once per
        // attempt, the next command (or its resend) making the next.
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(None)
            .set_pipeline_buffer_size(1024);
        let connecting = client.clone();
        let connect = Box::new(move |_| {
            let (client, config) = (connecting.clone(), config.clone());
            async move {
                let made = client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await;
                made.inspect_err(|e| tracing::debug!(error = %e, "cannot connect"))
            }
            .boxed()
        });
        // A refused connection is tried again at once by the resend: the server may
        // have come up since the attempt the command waited for began.
        let connection = Attempts::new(tokio::runtime::Handle::current(), Duration::ZERO, connect);
        Resending(Arc::new(Link { client, connection }))
    }

    /// Sends `cmd`, and once more if the connection was found broken.
    pub(crate) async fn send(&self, cmd: &Cmd) -> RedisResult<Value> {
        self.resending(|mut conn| async move { conn.send_packed_command(cmd).await })
            .await
    }

    /// Sends `count` commands of `pipeline` from `offset`, and once more if the
    /// connection was found broken.
    pub(crate) async fn send_many(
        &self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        self.resending(|mut conn| async move {
            conn.send_packed_commands(pipeline, offset, count).await
        })
        .await
    }

    async fn resending<T, F>(&self, send: impl Fn(MultiplexedConnection) -> F) -> RedisResult<T>
    where
        F: Future<Output = RedisResult<T>>,
    {
        match self.send_once(&send).await {
            // Found broken or not made: the resend makes a new one. `is_connection_dropped`
            // covers a reset, aborted or closed connection and a refusal, not a timeout.
            Err(e) if e.is_connection_dropped() && !e.is_timeout() => {
                tracing::debug!(error = %e, "connection found broken: sending again");
                self.send_once(&send).await
            }
            other => other,
        }
    }

    /// Sends on the connection, in line behind the callers that waited for it
    /// (`attempt.rs`); a connection an error says is of no further use (redis-rs's
    /// `is_unrecoverable_error`: dropped, or a reply it could not parse) is made again.
    async fn send_once<T, F>(&self, send: &impl Fn(MultiplexedConnection) -> F) -> RedisResult<T>
    where
        F: Future<Output = RedisResult<T>>,
    {
        let connection = &self.0.connection;
        let got = connection.get().await;
        let conn = got.value?;
        let outcome = in_turn(got.place, pin!(send(conn))).await;
        if let Err(e) = &outcome
            && e.is_unrecoverable_error()
        {
            connection.renew(got.generation);
        }
        outcome
    }

    pub(crate) fn db(&self) -> i64 {
        self.0.client.get_connection_info().redis_settings().db()
    }
}

/// A connection that sends one command, or one pipeline, as `query_async` does,
/// without boxing the call where the connection allows it: `ConnectionLike` boxes
/// every call, and every lock call is one command or one pipeline.
pub(crate) trait SendOne: Send {
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

/// Any redis-rs connection (an application's own, for `fence::redis`; the cluster
/// connection), sending as `query_async` does.
pub(crate) struct Any<'a, C>(pub(crate) &'a mut C);

impl<C: ConnectionLike + Send> SendOne for Any<'_, C> {
    fn send_one<'a>(
        &'a mut self,
        cmd: &'a Cmd,
    ) -> impl Future<Output = RedisResult<Value>> + Send + 'a {
        cmd.query_async(self.0)
    }

    fn send_pipeline<'a>(
        &'a mut self,
        pipe: &'a Pipeline,
    ) -> impl Future<Output = RedisResult<Vec<RedisResult<Value>>>> + Send + 'a {
        pipe.query_async(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A send's future is boxed once per command (`batching/solo.rs`): it holds
    /// redis-rs's send future (about 1.1 KB) once. Held twice or more (an `async fn`
    /// given a future by value keeps it as its argument and again where it awaits it),
    /// it was 4.3 KB, and every command paid for the allocator's slow path and the cache
    /// misses of that much memory.
    #[tokio::test]
    async fn a_send_holds_redis_rs_future_once() {
        let conn = Resending::new(Client::open("redis://127.0.0.1:1/0").unwrap());
        let (cmd, pipe) = (redis::cmd("GET"), redis::pipe());
        let one = std::mem::size_of_val(&conn.send(&cmd));
        let many = std::mem::size_of_val(&conn.send_many(&pipe, 0, 0));
        for (send, size) in [("command", one), ("pipeline", many)] {
            assert!(size <= 2048, "a {send}'s send future is {size} B");
        }
    }
}
