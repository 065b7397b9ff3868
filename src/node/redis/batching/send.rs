//! How a caller's commands reach the node: at once and alone where a batch would do
//! no better, else through a batch ([`Batching::send`]); the connection traits the
//! node's operations send with.

use super::*;

/// One caller's replies, in the shape of its commands.
pub(super) enum Replies {
    One(Value),
    Many(Vec<Value>),
}

impl Replies {
    pub(super) fn one(self) -> Value {
        match self {
            Replies::One(value) => value,
            Replies::Many(mut values) => values.pop().unwrap_or(Value::Nil),
        }
    }

    pub(super) fn many(self) -> Vec<Value> {
        match self {
            Replies::One(value) => vec![value],
            Replies::Many(values) => values,
        }
    }
}

impl Batching {
    /// Batches under the multi-thread runtime this is made in; sends each command as
    /// it comes under the current-thread runtime.
    pub(crate) fn new(conn: Resending) -> Self {
        let flavor = tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor());
        Batching {
            node: Arc::new(NodeBatches {
                conn,
                open: Mutex::new(None),
                in_flight: AtomicUsize::new(0),
                batched: matches!(flavor, Ok(tokio::runtime::RuntimeFlavor::MultiThread)),
            }),
        }
    }

    /// Sends `commands` with those of the callers at the same node at the same time, and
    /// returns their replies (a connection error is every caller's).
    async fn send(&self, commands: Commands) -> RedisResult<Replies> {
        let mut place = Place::join(&self.node, commands);
        if place.leads {
            // Let the callers that are ready join, but only when this batch would wait
            // behind another anyway: alone, a command goes out at once.
            if self.node.in_flight.load(Ordering::Acquire) > 0 {
                // Tokio's yield (not a wake of our own): the caller runs again after the
                // tasks that are ready, not within a combinator's same poll.
                tokio::task::yield_now().await;
            }
            place.send_batch();
        }
        poll_fn(|cx| place.poll_replies(cx)).await
    }
}

impl Batching {
    /// Runs what `send` makes without a batch where that is what a batch would
    /// do: always where this node does not batch, and where nothing of the node is in
    /// flight and no batch is open ([`Solo`]). `None`: the caller joins a batch.
    async fn without_batch<'a, T, F, Fut>(&'a self, send: F) -> Option<T>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = T> + Send + 'a,
    {
        let make = || alone(send());
        if !self.node.batched {
            return Some(make().await);
        }
        Solo::start(&self.node, make).await
    }
}

impl SendOne for Batching {
    async fn send_one(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        let conn = &self.node.conn;
        let send = || async move { conn.send(cmd).await?.extract_error() };
        if let Some(reply) = self.without_batch(send).await {
            return reply;
        }
        self.send(Commands::One(cmd.clone()))
            .await?
            .one()
            .extract_error()
    }

    async fn send_pipeline(&mut self, pipe: &Pipeline) -> RedisResult<Vec<RedisResult<Value>>> {
        let conn = &self.node.conn;
        let send = || async move {
            let replies = conn.send_many(pipe, 0, pipe.len()).await?;
            Ok::<_, RedisError>(one_result_each(replies))
        };
        if pipe.is_empty() {
            return alone(send()).await;
        }
        if let Some(replies) = self.without_batch(send).await {
            return replies;
        }
        let commands = Commands::Many(pipe.cmd_iter().cloned().collect());
        Ok(one_result_each(self.send(commands).await?.many()))
    }
}

// For `query_async`: batched as well, so that every command of the node keeps its order.
impl ConnectionLike for Batching {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            if !self.node.batched {
                return self.node.conn.send(cmd).await;
            }
            Ok(self.send(Commands::One(cmd.clone())).await?.one())
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            if !self.node.batched || offset != 0 || count != pipeline.len() || count == 0 {
                // Unbatched, a transaction (its replies are not one per command), or
                // nothing: as is.
                return self.node.conn.send_many(pipeline, offset, count).await;
            }
            let commands = Commands::Many(pipeline.cmd_iter().cloned().collect());
            Ok(self.send(commands).await?.many())
        })
    }

    fn get_db(&self) -> i64 {
        self.node.conn.db()
    }
}
