//! Release notifications from one Redis server (a Sentinel node's: its current master),
//! or from one Redis Cluster (sharded pub/sub): one RESP3 connection per node, kept by a
//! single upkeep task.
//!
//! Waiters never talk to the server themselves: they register a channel (shared by the
//! resource's waiters, reference-counted) and wait until the upkeep task has it
//! subscribed; dropping the last reference makes the task unsubscribe. The task sends
//! the difference between what is wanted and what is subscribed, each command bounded
//! by [`COMMAND_TIMEOUT`], which answers two failures:
//!
//! * **A node restarted** (or any dropped connection): the task reconnects, with a
//!   capped backoff, for as long as any channel is wanted, subscribes them all again and
//!   wakes their waiters once, since a release may have been published in between.
//! * **A frozen node**: a command that does not answer in time makes the task drop the
//!   connection (ending its subscriptions on the server too) and start over. Nothing
//!   piles up meanwhile: one task per node, whose state is the set of channels wanted.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt};
use redis::aio::MultiplexedConnection;
#[cfg(feature = "cluster")]
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
#[cfg(feature = "cluster")]
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, Client, PushInfo, PushKind, Value};
use tokio::sync::{watch, Notify};

use crate::error::NodeError;
use crate::lock_unpoisoned as lock;
use crate::node::redis::call::node_error;
use crate::node::ReleaseSignal;

/// Bound of one SUBSCRIBE, UNSUBSCRIBE or connection attempt of the upkeep task.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(1);
/// First and largest wait between two failed attempts to reach the server.
const MIN_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// The pub/sub side of one node. Clones share it.
#[derive(Clone)]
pub(crate) struct Hub {
    shared: Arc<Shared>,
}

/// Builds the client of a cluster's pub/sub connection: seeds, credentials, TLS and
/// retries, without the protocol and push sender, which the hub sets.
#[cfg(feature = "cluster")]
pub(crate) type ClusterBuilder = dyn Fn() -> ClusterClientBuilder + Send + Sync;

/// Gives the client of the server to connect to now (a Sentinel node's current master).
pub(crate) type FindServer =
    dyn Fn() -> BoxFuture<'static, Result<Client, NodeError>> + Send + Sync;

/// Where the notifications come from, and so how a channel is (un)subscribed.
enum Source {
    /// One server, found at each connection: `SUBSCRIBE`, `UNSUBSCRIBE`.
    Server(Box<FindServer>),
    /// A cluster: `SSUBSCRIBE`, `SUNSUBSCRIBE`, routed by the channel's slot.
    #[cfg(feature = "cluster")]
    Cluster(Arc<ClusterBuilder>),
}

/// A pub/sub connection of either source.
enum Conn {
    Server(MultiplexedConnection),
    #[cfg(feature = "cluster")]
    Cluster(ClusterConnection),
}

struct Shared {
    name: Arc<str>,
    source: Source,
    channels: Mutex<HashMap<String, Weak<Channel>>>,
    /// Wakes the upkeep task: a channel was added or dropped, or the connection broke.
    work: Arc<Notify>,
    /// Generation of the current connection; pushes of older ones are stale.
    generation: AtomicU64,
    /// The generation whose connection reported a disconnection, if any (0: none).
    broken: AtomicU64,
    /// Channels whose subscription the server ended (a cluster slot that moved).
    ended: Mutex<HashSet<String>>,
    started: AtomicBool,
}

struct Channel {
    /// Bumped at every notification (and when notifications may have been missed).
    tx: watch::Sender<u64>,
    /// Whether the current connection is subscribed to the channel.
    active: watch::Sender<bool>,
    hub: Weak<Shared>,
}

impl Channel {
    fn wake(&self) {
        self.tx.send_modify(|n| *n = n.wrapping_add(1));
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        if let Some(hub) = self.hub.upgrade() {
            hub.work.notify_one();
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Lets the upkeep task see that the node is gone, and end.
        self.work.notify_one();
    }
}

impl Hub {
    /// A hub for the server of `client`, connecting on first use.
    pub(crate) fn new(name: Arc<str>, client: &Client) -> Result<Self, NodeError> {
        let client = resp3(client)?;
        let find = move || std::future::ready(Ok::<_, NodeError>(client.clone())).boxed();
        Ok(Self::found(name, Box::new(find)))
    }

    /// A hub for the server `find` names at each connection (see [`reset`](Self::reset)).
    pub(crate) fn found(name: Arc<str>, find: Box<FindServer>) -> Self {
        Self::with_source(name, Source::Server(find))
    }

    /// The server changed (a Sentinel's new master): as a lost connection, every waiter
    /// is woken to retry, and the channels are subscribed again on a new connection.
    #[cfg(feature = "sentinel")]
    pub(crate) fn reset(&self) {
        let shared = &self.shared;
        shared.disconnected(shared.generation.load(Ordering::Acquire));
    }

    /// A hub for a cluster, using sharded pub/sub; `builder` makes the client of each
    /// connection (it is opened again after a failure).
    #[cfg(feature = "cluster")]
    pub(crate) fn cluster(name: Arc<str>, builder: Arc<ClusterBuilder>) -> Self {
        Self::with_source(name, Source::Cluster(builder))
    }

    fn with_source(name: Arc<str>, source: Source) -> Self {
        Hub {
            shared: Arc::new(Shared {
                name,
                source,
                channels: Mutex::default(),
                work: Arc::new(Notify::new()),
                generation: AtomicU64::new(0),
                broken: AtomicU64::new(0),
                ended: Mutex::default(),
                started: AtomicBool::new(false),
            }),
        }
    }

    /// Subscribes to `name`: resolves once the server confirmed the subscription (or
    /// at once when it already was). The caller bounds the wait; giving up leaves
    /// nothing behind but the channel's unsubscription, done by the upkeep task.
    pub(crate) async fn subscribe(&self, name: String) -> Result<ReleaseSignal, NodeError> {
        let shared = &self.shared;
        let channel = {
            let mut channels = lock(&shared.channels);
            match channels.get(&name).and_then(Weak::upgrade) {
                Some(channel) => channel,
                None => {
                    let channel = Arc::new(Channel {
                        tx: watch::channel(0).0,
                        active: watch::channel(false).0,
                        hub: Arc::downgrade(shared),
                    });
                    channels.insert(name, Arc::downgrade(&channel));
                    channel
                }
            }
        };
        if !shared.started.swap(true, Ordering::AcqRel) {
            tokio::spawn(upkeep(Arc::downgrade(shared), shared.work.clone()));
        }
        shared.work.notify_one();
        let mut active = channel.active.subscribe();
        // The sender lives in `channel`, which we hold: this cannot fail.
        let _ = active.wait_for(|&on| on).await;
        Ok(ReleaseSignal::new(channel.tx.subscribe(), channel))
    }
}

/// What the upkeep task holds between rounds.
struct Link {
    generation: u64,
    conn: Conn,
    subscribed: HashSet<String>,
}

/// Keeps the connection subscribed to exactly the channels that have waiters.
async fn upkeep(hub: Weak<Shared>, work: Arc<Notify>) {
    let mut link: Option<Link> = None;
    // Channels that were subscribed on a connection that was lost: woken once they are
    // subscribed again, as a release may have been published in between.
    let mut resumed: HashSet<String> = HashSet::new();
    let mut backoff = MIN_BACKOFF;
    loop {
        // Registered before looking at the state, so a change made meanwhile is seen.
        let notified = work.notified();
        let Some(shared) = hub.upgrade() else {
            return;
        };
        if let Some(current) = &mut link {
            if shared.broken.load(Ordering::Acquire) == current.generation {
                resumed.extend(current.subscribed.iter().cloned());
                link = None;
            } else {
                let ended = std::mem::take(&mut *lock(&shared.ended));
                for name in ended {
                    if current.subscribed.remove(&name) {
                        resumed.insert(name);
                    }
                }
            }
        }
        let wanted = shared.wanted();
        resumed.retain(|name| wanted.contains_key(name));
        let subscribed = link.as_ref().map(|l| &l.subscribed);
        let to_subscribe: Vec<String> = wanted
            .keys()
            .filter(|name| subscribed.is_none_or(|s| !s.contains(*name)))
            .cloned()
            .collect();
        let to_unsubscribe: Vec<String> = subscribed
            .map(|s| {
                s.iter()
                    .filter(|name| !wanted.contains_key(*name))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        if let Some(subscribed) = subscribed {
            // A channel dropped and registered again before this round is still
            // subscribed: its new waiters need no command.
            for (name, channel) in &wanted {
                if subscribed.contains(name) && !*channel.active.borrow() {
                    channel.active.send_replace(true);
                }
            }
        }
        if to_subscribe.is_empty() && to_unsubscribe.is_empty() {
            drop((shared, wanted));
            notified.await;
            continue;
        }
        match shared
            .apply(&mut link, &to_subscribe, &to_unsubscribe)
            .await
        {
            Ok(()) => {
                backoff = MIN_BACKOFF;
                for name in &to_subscribe {
                    if let Some(channel) = wanted.get(name) {
                        channel.active.send_replace(true);
                        if resumed.remove(name) {
                            channel.wake();
                        }
                    }
                }
            }
            Err(e) => {
                tracing::debug!(node = %shared.name, error = %e, "pub/sub upkeep failed; reconnecting");
                if let Some(lost) = link.take() {
                    resumed.extend(lost.subscribed);
                }
                for channel in wanted.values() {
                    channel.active.send_replace(false);
                }
                drop((shared, wanted));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

impl Shared {
    /// The channels that still have waiters; forgets the others.
    fn wanted(&self) -> HashMap<String, Arc<Channel>> {
        let mut channels = lock(&self.channels);
        channels.retain(|_, channel| channel.strong_count() > 0);
        channels
            .iter()
            .filter_map(|(name, channel)| Some((name.clone(), channel.upgrade()?)))
            .collect()
    }

    /// Connects if needed, then unsubscribes and subscribes, each within the bound.
    async fn apply(
        self: &Arc<Self>,
        link: &mut Option<Link>,
        subscribe: &[String],
        unsubscribe: &[String],
    ) -> Result<(), NodeError> {
        if link.is_none() {
            if subscribe.is_empty() {
                // Nothing wanted, and no connection: nothing is subscribed anywhere.
                return Ok(());
            }
            *link = Some(self.connect().await?);
        }
        let Some(current) = link.as_mut() else {
            return Ok(());
        };
        match &mut current.conn {
            Conn::Server(conn) => {
                if !unsubscribe.is_empty() {
                    bounded(conn.unsubscribe(unsubscribe)).await?;
                    for name in unsubscribe {
                        current.subscribed.remove(name);
                    }
                }
                if !subscribe.is_empty() {
                    bounded(conn.subscribe(subscribe)).await?;
                    current.subscribed.extend(subscribe.iter().cloned());
                }
            }
            // One command per channel: the channels of one command must share a slot.
            #[cfg(feature = "cluster")]
            Conn::Cluster(conn) => {
                for name in unsubscribe {
                    bounded(conn.sunsubscribe(name)).await?;
                    current.subscribed.remove(name);
                }
                for name in subscribe {
                    bounded(conn.ssubscribe(name)).await?;
                    current.subscribed.insert(name.clone());
                }
            }
        }
        Ok(())
    }

    async fn connect(self: &Arc<Self>) -> Result<Link, NodeError> {
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        let routes = Arc::downgrade(self);
        let push_sender = move |push: PushInfo| -> Result<(), ()> {
            if let Some(shared) = routes.upgrade() {
                shared.route(generation, push);
            }
            Ok(())
        };
        let conn = match &self.source {
            Source::Server(find) => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(COMMAND_TIMEOUT))
                    .set_response_timeout(Some(COMMAND_TIMEOUT))
                    .set_push_sender(push_sender);
                let client = resp3(&find().await?)?;
                Conn::Server(
                    bounded(client.get_multiplexed_async_connection_with_config(&config)).await?,
                )
            }
            #[cfg(feature = "cluster")]
            Source::Cluster(builder) => {
                let client = builder()
                    .use_protocol(redis::ProtocolVersion::RESP3)
                    .push_sender(push_sender)
                    .build()
                    .map_err(node_error)?;
                let config = ClusterConfig::new()
                    .set_connection_timeout(COMMAND_TIMEOUT)
                    .set_response_timeout(COMMAND_TIMEOUT);
                Conn::Cluster(bounded(client.get_async_connection_with_config(config)).await?)
            }
        };
        Ok(Link {
            generation,
            conn,
            subscribed: HashSet::new(),
        })
    }

    /// The channel a push names, if it still has waiters.
    fn channel_of<'p>(&self, push: &'p PushInfo) -> Option<(&'p str, Arc<Channel>)> {
        let Some(Value::BulkString(name)) = push.data.first() else {
            return None;
        };
        let name = std::str::from_utf8(name).ok()?;
        let channels = lock(&self.channels);
        let channel = channels.get(name).and_then(Weak::upgrade)?;
        Some((name, channel))
    }

    fn route(&self, generation: u64, push: PushInfo) {
        match push.kind {
            PushKind::Message | PushKind::SMessage => {
                if let Some((_, channel)) = self.channel_of(&push) {
                    channel.wake();
                }
            }
            PushKind::SUnsubscribe => {
                // The task removes a channel before it unsubscribes it, so one that
                // still has waiters here was ended by the server: its slot moved to
                // another shard. Wake its waiters (a release may be missed meanwhile)
                // and have the task subscribe it again, which follows the slot.
                if generation != self.generation.load(Ordering::Acquire) {
                    return;
                }
                if let Some((name, channel)) = self.channel_of(&push) {
                    channel.active.send_replace(false);
                    channel.wake();
                    lock(&self.ended).insert(name.to_owned());
                    self.work.notify_one();
                }
            }
            PushKind::Disconnection => {
                if generation != self.generation.load(Ordering::Acquire) {
                    // A connection the task already let go of.
                    return;
                }
                self.disconnected(generation);
            }
            _ => {}
        }
    }

    /// Connection `generation` is lost: messages may have been lost too, so every waiter
    /// is woken to retry, and the task subscribes them again on a new connection.
    fn disconnected(&self, generation: u64) {
        for channel in live(&self.channels) {
            channel.active.send_replace(false);
            channel.wake();
        }
        self.broken.store(generation, Ordering::Release);
        self.work.notify_one();
    }
}

/// The channels of `channels` that still have waiters.
fn live<T>(channels: &Mutex<HashMap<String, Weak<T>>>) -> Vec<Arc<T>> {
    lock(channels).values().filter_map(Weak::upgrade).collect()
}

async fn bounded<T>(
    call: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> Result<T, NodeError> {
    match tokio::time::timeout(COMMAND_TIMEOUT, call).await {
        Ok(answer) => answer.map_err(node_error),
        Err(_) => Err(NodeError::Timeout(COMMAND_TIMEOUT)),
    }
}

/// `client`'s server, over RESP3 (for its pushes).
fn resp3(client: &Client) -> Result<Client, NodeError> {
    let info = client.get_connection_info().clone();
    let settings = info.redis_settings().clone();
    let settings = settings.set_protocol(redis::ProtocolVersion::RESP3);
    Client::open(info.set_redis_settings(settings)).map_err(node_error)
}
