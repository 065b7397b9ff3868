//! The node's one `LISTEN` connection, shared by every subscription: a release's
//! `pg_notify` names the resource's channel (hashed), and the listener bumps that
//! channel's signal.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::watch;

use super::sql::{node_error, CHANNEL};
use crate::error::NodeError;
use crate::node::ReleaseSignal;

/// How long the listener waits before connecting again after a failure.
const RECONNECT_DELAY: Duration = Duration::from_secs(1);

pub(super) struct Listener {
    options: PgConnectOptions,
    /// Each subscribed channel's hash and its signal; a signal lives as long as one of
    /// its subscriptions (they hold the `Arc`).
    signals: Mutex<HashMap<String, Weak<watch::Sender<u64>>>>,
    /// `true` while the `LISTEN` is in place; the task starts with the first subscribe.
    listening: watch::Sender<bool>,
    /// The task, started by the first subscribe, ended with the node.
    task: Mutex<Option<tokio::task::AbortHandle>>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        let task = self.task.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(task) = task.take() {
            task.abort();
        }
    }
}

impl Listener {
    pub(super) fn new(options: PgConnectOptions) -> Arc<Self> {
        Arc::new(Listener {
            options,
            signals: Mutex::default(),
            listening: watch::Sender::new(false),
            task: Mutex::default(),
        })
    }

    /// A signal for `channel`, once the `LISTEN` is in place (the locker bounds the wait
    /// with its node timeout, then falls back on its retry policy).
    pub(super) async fn subscribe(
        self: &Arc<Self>,
        channel: &str,
    ) -> Result<ReleaseSignal, NodeError> {
        crate::lock_unpoisoned(&self.task).get_or_insert_with(|| {
            let task = run(Arc::downgrade(self), self.options.clone());
            tokio::spawn(task).abort_handle()
        });
        let mut listening = self.listening.subscribe();
        listening
            .wait_for(|&on| on)
            .await
            .map_err(|_| NodeError::Connection("the LISTEN task ended".into()))?;
        let hash = super::sql::notified(channel);
        let mut signals = crate::lock_unpoisoned(&self.signals);
        let sender = match signals.get(&hash).and_then(Weak::upgrade) {
            Some(sender) => sender,
            None => {
                // Forget the channels nobody listens to any more before adding one.
                signals.retain(|_, signal| signal.strong_count() > 0);
                let sender = Arc::new(watch::Sender::new(0));
                signals.insert(hash, Arc::downgrade(&sender));
                sender
            }
        };
        Ok(ReleaseSignal::new(sender.subscribe(), sender))
    }

    fn wake(&self, hash: Option<&str>) {
        let signals = crate::lock_unpoisoned(&self.signals);
        let bump = |signal: &Weak<watch::Sender<u64>>| {
            if let Some(sender) = signal.upgrade() {
                sender.send_modify(|n| *n = n.wrapping_add(1));
            }
        };
        match hash {
            Some(hash) => signals.get(hash).into_iter().for_each(bump),
            None => signals.values().for_each(bump),
        }
    }
}

/// Listens until the node is dropped, connecting again after every failure.
async fn run(listener: Weak<Listener>, options: PgConnectOptions) {
    // A pool of one, only for sqlx's reconnection of the listener.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_lazy_with(options);
    loop {
        let session = async {
            let mut pg = PgListener::connect_with(&pool).await?;
            pg.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(pg)
        };
        let mut pg = match session.await {
            Ok(pg) => pg,
            Err(e) => {
                tracing::warn!(error = %node_error(e), "PostgreSQL node: LISTEN failed; waiters poll meanwhile");
                tokio::time::sleep(RECONNECT_DELAY).await;
                continue;
            }
        };
        let Some(this) = listener.upgrade() else {
            return;
        };
        this.listening.send_replace(true);
        drop(this);
        loop {
            let next = pg.try_recv().await;
            let Some(this) = listener.upgrade() else {
                return;
            };
            match next {
                Ok(Some(notification)) => this.wake(Some(notification.payload())),
                // The connection dropped and sqlx listens again on a new one: a release
                // in between was not heard, so every waiter tries once more.
                Ok(None) => this.wake(None),
                Err(_) => {
                    this.listening.send_replace(false);
                    this.wake(None);
                    break;
                }
            }
        }
    }
}
