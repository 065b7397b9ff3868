//! [`EtcdNode`]: one etcd cluster as a lock node, with fencing tokens that need no clock.

use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse,
    WatchFilterType, WatchOptions,
};
use tokio::sync::{watch, OnceCell};

use crate::error::{ConfigError, NodeError};
use crate::node::FencingToken;
use crate::node::LockKeys;
use crate::node::{AcquireReply, AcquireRequest, Node, NodeFuture, Owner, ReleaseSignal};
use crate::node::{ClaimReply, ClaimRequest, Record, RecordStore, StoreReply, StoreRequest};

/// How often a record operation re-reads after another writer changed the record key
/// between its read and its transaction, before it gives up.
const RECORD_ATTEMPTS: usize = 16;

/// An etcd cluster as one lock node (feature `etcd`): fencing tokens that need no clock.
///
/// # Why etcd
///
/// Redlock's safety rests on timing: bounded clock drift, no process pause longer than
/// the validity, nodes that keep their keys for a whole ttl. Its fencing tokens are
/// counters a majority agrees on, floored by a clock when a counter comes back behind
/// (see [`fencing`](crate::lock::fencing)). etcd replaces all of that with consensus:
///
/// - **The token is the lock key's create revision.** etcd's revision is one counter
///   for the whole cluster, advanced by raft for every write and persisted in the
///   write-ahead log before a write is acknowledged. A later holder creates the key at
///   a later revision, so tokens increase strictly — across leader changes, members
///   killed, the whole cluster restarted from its data directories — without a clock,
///   without a counter ttl and without a write-back.
/// - **Expiry is the leader's business.** The lock key is attached to an etcd lease;
///   leases are timed by the leader alone and a new leader extends every lease by an
///   election timeout, so a key never expires early because clocks disagree.
/// - **A majority of the cluster is a single vote here**: the quorum lives inside etcd,
///   so the locker needs exactly one node.
///
/// What etcd cannot give either: a holder that is paused past its ttl still believes
/// it holds the lock until it looks; only the fencing token, checked by the storage it
/// writes to, stops its late write. That is the point of a token the store makes
/// monotonic.
///
/// # Mapping onto [`Node`]
///
/// | operation | etcd |
/// |---|---|
/// | acquire | grant a lease (ttl in whole seconds), then one transaction: `if create_revision(key) == 0 then put(key, owner, lease) else get(key)`; on success the token is the transaction's revision; when held, the holder's lease's remaining ttl |
/// | extend | `if value(key) == owner then get(key)`, then one keep-alive of the key's lease; never re-creates a key |
/// | release | `if value(key) == owner then get(key), delete(key)`, then revoke the lease |
/// | raise the fence | nothing to do: the revision is the token |
/// | the clock floor ([`AcquireRequest::fence_floor`]) | ignored: a revision never comes back behind, and a floor would tie the token to a clock again |
/// | wake-up | a watch on the key's deletions (a release, or the lease's expiry) |
/// | outcome records | a key per resource holding an encoded record, attached to a lease of its own (the record's ttl), written in transactions that compare the lock key's value with the owner and the record key's mod revision with what was read |
///
/// A transaction whose comparison fails is an answer (held, not the owner); a call
/// that fails or times out is a [`NodeError`]: held and unavailable stay apart as for
/// Redis.
///
/// # Ttl
///
/// etcd leases count whole seconds and etcd raises a ttl below its minimum (one and a
/// half election timeouts, 1.5 s with the default configuration) silently. A locker
/// with an etcd node therefore refuses, when it is built, a lease ttl that is not a
/// whole number of seconds or is shorter than [`EtcdNode::MIN_TTL`]. Record ttls are
/// rounded up to whole seconds.
///
/// # Node timeout
///
/// Every write is a raft commit: an fsync on a majority of members. The locker's
/// default [`node_timeout`](crate::LockOptions::node_timeout) of 50 ms, chosen for
/// Redis, is short for that on ordinary disks; give etcd a few hundred milliseconds.
///
/// # Mixing with Redis nodes
///
/// A locker with an etcd node must have no other node: with other nodes the token
/// would be the maximum of incomparable numbers (a revision and a Redis counter) and
/// the quorum argument needs every node of a majority to raise its counter, which a
/// revision cannot. Such a locker is refused with a [`ConfigError`].
///
/// # Example
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tower_redlock::{EtcdNode, LockOptions, Redlock};
///
/// let node = EtcdNode::new(["127.0.0.1:2379", "127.0.0.1:22379"], "locks/")?;
/// assert_eq!(node.name(), "etcd://127.0.0.1:2379,127.0.0.1:22379/locks/");
/// let locker = Redlock::new(
///     [node],
///     LockOptions::default()
///         .ttl(Duration::from_secs(10))
///         .node_timeout(Duration::from_millis(500)),
/// )?;
/// # let _ = locker;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct EtcdNode {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    endpoints: Vec<String>,
    prefix: Vec<u8>,
    user: Option<(String, String)>,
    /// One client per member, connected on first use.
    clients: Vec<OnceCell<Client>>,
    /// The member calls go to, until one fails (see [`pinned!`]).
    current: AtomicUsize,
}

impl Inner {
    fn build(
        name: String,
        endpoints: Vec<String>,
        prefix: Vec<u8>,
        user: Option<(String, String)>,
    ) -> Self {
        Inner {
            name,
            clients: endpoints.iter().map(|_| OnceCell::new()).collect(),
            endpoints,
            prefix,
            user,
            current: AtomicUsize::new(0),
        }
    }
}

/// Runs one node operation on the pinned member, moving on to the next member when it
/// cannot be reached (at most once round all members).
///
/// etcd-client balances over all endpoints but keeps sending to a member that is down
/// (each call fails with a connection error), so the node pins one member, as etcd's
/// own Go client does, and moves on when that member fails. A call that was dropped
/// unanswered (the locker's timeout) moves on too: a paused or partitioned member must
/// not hold every later call. Re-running an operation is safe: each one is written so
/// that running it twice answers as running it once (an acquire that finds its own
/// owner value in the key reports it acquired).
macro_rules! pinned {
    ($inner:expr, |$client:ident| $body:expr) => {{
        let inner: &Inner = &$inner;
        let mut last = None;
        let mut answer = None;
        for _ in 0..inner.endpoints.len() {
            let (index, $client) = inner.pinned().await?;
            let guard = MoveOnFailure::new(inner, index);
            match $body.await {
                Err(e @ NodeError::Connection(_)) => {
                    drop(guard);
                    last = Some(e);
                }
                other => {
                    guard.disarm();
                    answer = Some(other);
                    break;
                }
            }
        }
        match answer {
            Some(answer) => answer,
            None => Err(last.unwrap_or_else(|| NodeError::Connection("no etcd endpoint".into()))),
        }
    }};
}

/// Moves the node's pinned member past `index` when dropped armed.
struct MoveOnFailure<'a> {
    inner: &'a Inner,
    index: usize,
    armed: bool,
}

impl<'a> MoveOnFailure<'a> {
    fn new(inner: &'a Inner, index: usize) -> Self {
        MoveOnFailure {
            inner,
            index,
            armed: true,
        }
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for MoveOnFailure<'_> {
    fn drop(&mut self) {
        if self.armed {
            let next = (self.index + 1) % self.inner.endpoints.len();
            // Only if no other call moved it already.
            let _ = self.inner.current.compare_exchange(
                self.index,
                next,
                AtomicOrdering::Relaxed,
                AtomicOrdering::Relaxed,
            );
        }
    }
}

impl EtcdNode {
    /// The shortest lease ttl a locker with an etcd node accepts: etcd raises shorter
    /// lease ttls to one and a half election timeouts (1.5 s by default), rounded up.
    pub const MIN_TTL: Duration = Duration::from_secs(2);

    /// A node over the cluster reachable at `endpoints` (`host:port` or
    /// `http://host:port`, one or more members), every key prefixed with `prefix`.
    /// Never connects: the client connects on first use.
    pub fn new<E: AsRef<str>>(
        endpoints: impl IntoIterator<Item = E>,
        prefix: impl Into<String>,
    ) -> Result<Self, ConfigError> {
        let endpoints: Vec<String> = endpoints
            .into_iter()
            .map(|e| e.as_ref().trim().to_owned())
            .collect();
        if endpoints.is_empty() || endpoints.iter().any(String::is_empty) {
            return Err(ConfigError::new(
                "an etcd node needs at least one endpoint host:port",
            ));
        }
        let mut hosts = Vec::with_capacity(endpoints.len());
        for endpoint in &endpoints {
            let host = endpoint.strip_prefix("http://").unwrap_or(endpoint);
            if host.starts_with("https://") {
                return Err(ConfigError::new(
                    "etcd over TLS is not supported by this crate's etcd feature yet",
                ));
            }
            let valid = host.rsplit_once(':').is_some_and(|(h, port)| {
                !h.is_empty() && !h.contains('/') && port.parse::<u16>().is_ok()
            });
            if !valid {
                return Err(ConfigError::new(format!(
                    "bad etcd endpoint `{endpoint}`: expected host:port"
                )));
            }
            hosts.push(host.to_owned());
        }
        let prefix = prefix.into();
        Ok(EtcdNode {
            inner: Arc::new(Inner::build(
                format!("etcd://{}/{prefix}", hosts.join(",")),
                hosts.iter().map(|h| format!("http://{h}")).collect(),
                prefix.into_bytes(),
                None,
            )),
        })
    }

    /// A node from a URL `etcd://[user:password@]host1:port1,host2:port2[/prefix]`.
    /// A non-empty prefix gets a trailing `/` (`etcd://h:2379/locks` keeps its keys
    /// under `locks/`). Credentials are percent-encoded and never appear in the name.
    pub fn from_url(url: &str) -> Result<Self, ConfigError> {
        let rest = url
            .strip_prefix("etcd://")
            .ok_or_else(|| ConfigError::new("an etcd node URL starts with etcd://"))?;
        if rest.contains(['?', '#']) {
            return Err(ConfigError::new(
                "an etcd URL takes no query or fragment: etcd://host1:port1,host2:port2/prefix",
            ));
        }
        let (authority, path) = match rest.split_once('/') {
            Some((authority, path)) => (authority, path),
            None => (rest, ""),
        };
        let (user, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => {
                let (name, password) = userinfo.split_once(':').ok_or_else(|| {
                    ConfigError::new("etcd credentials are written user:password@")
                })?;
                (
                    Some((percent_decode(name)?, percent_decode(password)?)),
                    hosts,
                )
            }
            None => (None, authority),
        };
        let mut prefix = percent_decode(path)?;
        if !prefix.is_empty() && !prefix.ends_with('/') {
            prefix.push('/');
        }
        let mut node = Self::new(hosts.split(','), prefix)?;
        if let Some(user) = user {
            node = node.with_user(user.0, user.1);
        }
        Ok(node)
    }

    /// This node authenticating as `user` (etcd's own users and roles).
    #[must_use]
    pub fn with_user(self, user: impl Into<String>, password: impl Into<String>) -> Self {
        let inner = &self.inner;
        EtcdNode {
            inner: Arc::new(Inner::build(
                inner.name.clone(),
                inner.endpoints.clone(),
                inner.prefix.clone(),
                Some((user.into(), password.into())),
            )),
        }
    }

    /// The node's name, `etcd://host1:port1,host2:port2/prefix`, without credentials.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Checks that a locker's ttl and node count suit an etcd node (see the type's
    /// documentation).
    pub(crate) fn check(ttl: Duration, nodes: usize) -> Result<(), ConfigError> {
        if nodes > 1 {
            return Err(ConfigError::new(
                "an etcd node must be the locker's only node: etcd is a quorum already, and \
                 its revisions cannot be combined with other nodes' fence counters",
            ));
        }
        if ttl.subsec_nanos() != 0 {
            return Err(ConfigError::new(format!(
                "etcd leases count whole seconds: a ttl of {ttl:?} would live {}s; give a whole \
                 number of seconds",
                whole_seconds(ttl)
            )));
        }
        if ttl < Self::MIN_TTL {
            return Err(ConfigError::new(format!(
                "a ttl of {ttl:?} is below etcd's minimum lease ttl; use at least {:?}",
                Self::MIN_TTL
            )));
        }
        Ok(())
    }
}

impl Inner {
    /// The pinned member's index and its client.
    async fn pinned(&self) -> Result<(usize, Client), NodeError> {
        let index = self.current.load(AtomicOrdering::Relaxed) % self.endpoints.len();
        let client = self.clients[index]
            .get_or_try_init(|| async {
                let mut options = ConnectOptions::new()
                    .with_require_leader(true)
                    .with_connect_timeout(Duration::from_secs(2))
                    .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2));
                if let Some((user, password)) = &self.user {
                    options = options.with_user(user.clone(), password.clone());
                }
                Client::connect([&self.endpoints[index]], Some(options))
                    .await
                    .map_err(node_error)
            })
            .await?
            .clone();
        Ok((index, client))
    }

    fn key(&self, key: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.prefix.len() + key.len());
        out.extend_from_slice(&self.prefix);
        out.extend_from_slice(key.as_bytes());
        out
    }

    async fn acquire(
        &self,
        mut client: Client,
        keys: LockKeys,
        owner: Owner,
        ttl: Duration,
        fencing: bool,
    ) -> Result<AcquireReply, NodeError> {
        let key = self.key(&keys.lock);
        let lease = client
            .lease_grant(whole_seconds(ttl), None)
            .await
            .map_err(node_error)?
            .id();
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                owner.as_str(),
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key, None)]);
        let reply = match client.txn(txn).await {
            Ok(reply) => reply,
            Err(e) => {
                // The put may have landed: the locker's cleanup deletes the key by owner
                // and revokes its lease. Otherwise the lease expires with its ttl.
                return Err(node_error(e));
            }
        };
        if reply.succeeded() {
            let revision = reply.header().map_or(0, |h| h.revision());
            let fence = u64::try_from(revision)
                .ok()
                .filter(|&r| r > 0)
                .ok_or_else(|| NodeError::Protocol("etcd answered without a revision".into()))?;
            return Ok(AcquireReply::Acquired {
                fence: if fencing { fence } else { 0 },
            });
        }
        revoke_in_background(&client, lease);
        let holder = first_kv(&reply);
        if let Some((value, _, created)) = &holder {
            if value.as_slice() == owner.as_str().as_bytes() {
                // Our own key: an earlier run of this very acquire landed (its answer
                // was lost with the connection). Acquired, with that run's revision.
                let fence = u64::try_from(*created).unwrap_or(0);
                return Ok(AcquireReply::Acquired {
                    fence: if fencing { fence } else { 0 },
                });
            }
        }
        let pttl = match holder.map(|(_, lease, _)| lease) {
            Some(lease) if lease != 0 => Some(lease_ttl(&mut client, lease).await?),
            // The holder's key vanished between the compare and the get (it cannot, in
            // one transaction), or carries no lease: nothing to tell.
            _ => None,
        };
        Ok(AcquireReply::Held { pttl })
    }

    async fn extend(
        &self,
        mut client: Client,
        keys: LockKeys,
        owner: Owner,
    ) -> Result<bool, NodeError> {
        let key = self.key(&keys.lock);
        let txn = Txn::new()
            .when([Compare::value(
                key.clone(),
                CompareOp::Equal,
                owner.as_str(),
            )])
            .and_then([TxnOp::get(key, None)]);
        let reply = client.txn(txn).await.map_err(node_error)?;
        let Some((_, lease, _)) = reply.succeeded().then(|| first_kv(&reply)).flatten() else {
            return Ok(false);
        };
        // The lease was drawn for this acquisition alone, so renewing it renews our key
        // and nothing else; a lease gone in between (released, expired) reads as lost.
        match client.lease_keep_alive(lease).await {
            Ok(_) => Ok(true),
            Err(etcd_client::Error::LeaseKeepAliveError(_)) => Ok(false),
            Err(e) => Err(node_error(e)),
        }
    }

    async fn release(
        &self,
        mut client: Client,
        keys: LockKeys,
        owner: Owner,
    ) -> Result<bool, NodeError> {
        let key = self.key(&keys.lock);
        let txn = Txn::new()
            .when([Compare::value(
                key.clone(),
                CompareOp::Equal,
                owner.as_str(),
            )])
            .and_then([TxnOp::get(key.clone(), None), TxnOp::delete(key, None)]);
        let reply = client.txn(txn).await.map_err(node_error)?;
        if !reply.succeeded() {
            return Ok(false);
        }
        if let Some((_, lease, _)) = first_kv(&reply) {
            // The key is gone already; the lease holds nothing else. Revoking it only
            // tidies up, so a failure here does not undo the release.
            let _ = client.lease_revoke(lease).await;
        }
        Ok(true)
    }

    async fn subscribe(
        &self,
        mut client: Client,
        keys: LockKeys,
    ) -> Result<ReleaseSignal, NodeError> {
        let key = self.key(&keys.lock);
        let mut stream = client
            .watch(
                key,
                Some(WatchOptions::new().with_filters([WatchFilterType::NoPut])),
            )
            .await
            .map_err(node_error)?;
        // The subscription is active once etcd confirmed the watch.
        match stream.message().await.map_err(node_error)? {
            Some(reply) if reply.created() => {}
            _ => return Err(NodeError::Protocol("etcd did not confirm the watch".into())),
        }
        let (tx, rx) = watch::channel(0u64);
        let task = tokio::spawn(async move {
            // Ends when the stream breaks: the sender drops with it and the waiters fall
            // back on their retry delay.
            while let Ok(Some(reply)) = stream.message().await {
                if reply.canceled() {
                    break;
                }
                if !reply.events().is_empty() {
                    tx.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
        });
        Ok(ReleaseSignal::new(
            rx,
            Arc::new(AbortOnDrop(task.abort_handle())),
        ))
    }

    // ---- Outcome records ----------------------------------------------------------

    async fn read_record(
        &self,
        mut client: Client,
        keys: LockKeys,
    ) -> Result<Option<Record>, NodeError> {
        let reply = client
            .get(self.key(&keys.record()), None)
            .await
            .map_err(node_error)?;
        match reply.kvs().first() {
            Some(kv) => Ok(Stored::decode(kv.value())?.completed()),
            None => Ok(None),
        }
    }

    /// `ttls`: the pending marker's, and the one given once to an earlier holder's marker.
    async fn claim_record(
        &self,
        mut client: Client,
        keys: LockKeys,
        owner: Owner,
        (token, fingerprint): (u64, Bytes),
        (pending_ttl, orphan_ttl): (Duration, Option<Duration>),
    ) -> Result<ClaimReply, NodeError> {
        let lock = self.key(&keys.lock);
        let record_key = self.key(&keys.record());
        for _ in 0..RECORD_ATTEMPTS {
            let current = read_stored(&mut client, &record_key).await?;
            // A completed record answers whoever asks, as the Redis script does.
            if let Some(record) = current.as_ref().and_then(|(stored, ..)| stored.completed()) {
                return Ok(ClaimReply::Completed(record));
            }
            let (write, reply_lease) = match &current {
                Some((stored, ..)) if stored.token == token => (None, None),
                Some((stored, lease, _)) if stored.orphan => (None, Some(*lease)),
                Some((stored, lease, _)) => {
                    let orphaned = Stored {
                        orphan: true,
                        ..stored.clone()
                    };
                    let lease = match orphan_ttl {
                        Some(ttl) => client
                            .lease_grant(whole_seconds(ttl), None)
                            .await
                            .map_err(node_error)?
                            .id(),
                        None => *lease,
                    };
                    (Some((orphaned, lease)), Some(lease))
                }
                None => {
                    let lease = client
                        .lease_grant(whole_seconds(pending_ttl), None)
                        .await
                        .map_err(node_error)?
                        .id();
                    let marker = Stored {
                        done: false,
                        orphan: false,
                        token,
                        fingerprint: fingerprint.clone(),
                        data: Bytes::new(),
                    };
                    (Some((marker, lease)), None)
                }
            };
            let new_lease = write.as_ref().map(|(_, lease)| *lease);
            let outcome = guarded_write(
                &mut client,
                &lock,
                &owner,
                &record_key,
                current.as_ref().map(|(_, _, rev)| *rev),
                write.map(|(stored, lease)| (stored.encode(), lease)),
            )
            .await?;
            let old_lease = current.as_ref().map(|(_, lease, _)| *lease);
            match outcome {
                Guarded::Written => {
                    if new_lease != old_lease {
                        if let Some(old) = old_lease {
                            revoke_in_background(&client, old);
                        }
                    }
                }
                Guarded::NotOwner | Guarded::Changed => {
                    if let Some(lease) = new_lease.filter(|l| Some(*l) != old_lease) {
                        revoke_in_background(&client, lease);
                    }
                    if matches!(outcome, Guarded::NotOwner) {
                        return Ok(ClaimReply::NotOwner);
                    }
                    continue;
                }
            }
            return match reply_lease {
                None => Ok(ClaimReply::Claimed),
                Some(0) => Ok(ClaimReply::Orphaned { pttl: None }),
                Some(lease) => Ok(ClaimReply::Orphaned {
                    pttl: Some(lease_ttl(&mut client, lease).await?),
                }),
            };
        }
        Err(busy())
    }

    async fn store_record(
        &self,
        mut client: Client,
        keys: LockKeys,
        owner: Owner,
        record: Record,
        retention: Duration,
    ) -> Result<StoreReply, NodeError> {
        let lock = self.key(&keys.lock);
        let record_key = self.key(&keys.record());
        let token = record.token().get();
        let wanted = Stored {
            done: true,
            orphan: false,
            token,
            fingerprint: record.fingerprint().clone(),
            data: record.data().clone(),
        };
        for _ in 0..RECORD_ATTEMPTS {
            let current = read_stored(&mut client, &record_key).await?;
            let (write, answer) = match &current {
                // A re-sent store of the very record finds its first send landed.
                Some((stored, ..)) if *stored == wanted => (None, StoreReply::Stored),
                Some((stored, ..)) if stored.done && stored.token >= token => {
                    (None, StoreReply::Superseded)
                }
                _ => {
                    let lease = client
                        .lease_grant(whole_seconds(retention), None)
                        .await
                        .map_err(node_error)?
                        .id();
                    (Some((wanted.encode(), lease)), StoreReply::Stored)
                }
            };
            let new_lease = write.as_ref().map(|(_, lease)| *lease);
            let outcome = guarded_write(
                &mut client,
                &lock,
                &owner,
                &record_key,
                current.as_ref().map(|(_, _, rev)| *rev),
                write,
            )
            .await?;
            let old_lease = current.as_ref().map(|(_, lease, _)| *lease);
            match outcome {
                Guarded::Written => {
                    if let (Some(_), Some(old)) = (new_lease, old_lease) {
                        revoke_in_background(&client, old);
                    }
                    return Ok(answer);
                }
                Guarded::NotOwner | Guarded::Changed => {
                    if let Some(lease) = new_lease {
                        revoke_in_background(&client, lease);
                    }
                    if matches!(outcome, Guarded::NotOwner) {
                        return Ok(StoreReply::NotOwner);
                    }
                }
            }
        }
        Err(busy())
    }

    async fn discard_record(
        &self,
        mut client: Client,
        keys: LockKeys,
        token: u64,
    ) -> Result<bool, NodeError> {
        let record_key = self.key(&keys.record());
        for _ in 0..RECORD_ATTEMPTS {
            let Some((stored, lease, revision)) = read_stored(&mut client, &record_key).await?
            else {
                return Ok(false);
            };
            if stored.done || stored.token != token {
                return Ok(false);
            }
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    record_key.clone(),
                    CompareOp::Equal,
                    revision,
                )])
                .and_then([TxnOp::delete(record_key.clone(), None)]);
            if client.txn(txn).await.map_err(node_error)?.succeeded() {
                if lease != 0 {
                    revoke_in_background(&client, lease);
                }
                return Ok(true);
            }
        }
        Err(busy())
    }
}

/// What [`guarded_write`] did.
enum Guarded {
    /// The lock key held the owner and the record key was as read: the write (if any)
    /// is done.
    Written,
    /// The lock key does not hold the owner: nothing was written.
    NotOwner,
    /// The record key changed since it was read: read again.
    Changed,
}

/// One transaction: if the lock key holds `owner` and the record key is as it was read
/// (`revision`: its mod revision, `None`: absent), put `write` (value, lease) there.
async fn guarded_write(
    client: &mut Client,
    lock: &[u8],
    owner: &Owner,
    record_key: &[u8],
    revision: Option<i64>,
    write: Option<(Vec<u8>, i64)>,
) -> Result<Guarded, NodeError> {
    let unchanged = match revision {
        Some(revision) => Compare::mod_revision(record_key.to_vec(), CompareOp::Equal, revision),
        None => Compare::create_revision(record_key.to_vec(), CompareOp::Equal, 0),
    };
    let ops: Vec<TxnOp> = write
        .into_iter()
        .map(|(value, lease)| {
            let options = (lease != 0).then(|| PutOptions::new().with_lease(lease));
            TxnOp::put(record_key.to_vec(), value, options)
        })
        .collect();
    let txn = Txn::new()
        .when([
            Compare::value(lock.to_vec(), CompareOp::Equal, owner.as_str()),
            unchanged,
        ])
        .and_then(ops)
        .or_else([TxnOp::get(lock.to_vec(), None)]);
    let reply = client.txn(txn).await.map_err(node_error)?;
    if reply.succeeded() {
        return Ok(Guarded::Written);
    }
    let ours = first_kv(&reply).is_some_and(|(value, ..)| value == owner.as_str().as_bytes());
    Ok(if ours {
        Guarded::Changed
    } else {
        Guarded::NotOwner
    })
}

/// The record key's decoded value, its lease and its mod revision.
async fn read_stored(
    client: &mut Client,
    record_key: &[u8],
) -> Result<Option<(Stored, i64, i64)>, NodeError> {
    let reply = client
        .get(record_key.to_vec(), None)
        .await
        .map_err(node_error)?;
    reply
        .kvs()
        .first()
        .map(|kv| Ok((Stored::decode(kv.value())?, kv.lease(), kv.mod_revision())))
        .transpose()
}

/// The first key-value of the first range answer of a transaction: value, lease and
/// create revision.
fn first_kv(reply: &TxnResponse) -> Option<(Vec<u8>, i64, i64)> {
    reply.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(get) => get
            .kvs()
            .first()
            .map(|kv| (kv.value().to_vec(), kv.lease(), kv.create_revision())),
        _ => None,
    })
}

async fn lease_ttl(client: &mut Client, lease: i64) -> Result<Duration, NodeError> {
    let reply = client
        .lease_time_to_live(lease, None)
        .await
        .map_err(node_error)?;
    // etcd answers -1 for a lease that expired in between: free now.
    Ok(Duration::from_secs(u64::try_from(reply.ttl()).unwrap_or(0)))
}

fn revoke_in_background(client: &Client, lease: i64) {
    if tokio::runtime::Handle::try_current().is_err() {
        return;
    }
    let mut client = client.clone();
    // Unused leases expire on their own; revoking them early only saves etcd memory.
    tokio::spawn(async move {
        let _ = client.lease_revoke(lease).await;
    });
}

/// Whole seconds, rounded up, at least one.
fn whole_seconds(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
}

fn node_error(error: etcd_client::Error) -> NodeError {
    use etcd_client::Error;
    match error {
        Error::TransportError(e) => NodeError::Connection(e.to_string().into()),
        Error::IoError(e) => NodeError::Connection(e.to_string().into()),
        // `Unavailable`: the member cannot be reached or has no leader (the client
        // asks for one): another member may serve.
        Error::GRpcStatus(status) if status.code() == tonic::Code::Unavailable => {
            NodeError::Connection(status.message().into())
        }
        Error::GRpcStatus(status) => {
            NodeError::Server(format!("{:?}: {}", status.code(), status.message()).into())
        }
        other => NodeError::Server(other.to_string().into()),
    }
}

fn busy() -> NodeError {
    NodeError::Server("the record key kept changing under concurrent writers".into())
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A record key's value: a pending marker or a completed record.
///
/// Layout: `b'd'` (done) or `b'p'` (pending), an orphan byte (0 or 1), the token as
/// 8 bytes big-endian, the fingerprint's length as 4 bytes big-endian, the
/// fingerprint, then the data.
#[derive(Clone, PartialEq, Eq)]
struct Stored {
    done: bool,
    orphan: bool,
    token: u64,
    fingerprint: Bytes,
    data: Bytes,
}

impl Stored {
    const HEADER: usize = 1 + 1 + 8 + 4;

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::HEADER + self.fingerprint.len() + self.data.len());
        out.push(if self.done { b'd' } else { b'p' });
        out.push(u8::from(self.orphan));
        out.extend_from_slice(&self.token.to_be_bytes());
        let len = u32::try_from(self.fingerprint.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&self.fingerprint);
        out.extend_from_slice(&self.data);
        out
    }

    fn decode(value: &[u8]) -> Result<Self, NodeError> {
        let bad = || NodeError::Protocol("the record key holds no record of this crate".into());
        if value.len() < Self::HEADER {
            return Err(bad());
        }
        let done = match value[0] {
            b'd' => true,
            b'p' => false,
            _ => return Err(bad()),
        };
        let orphan = value[1] == 1;
        let token = u64::from_be_bytes(value[2..10].try_into().map_err(|_| bad())?);
        let len = u32::from_be_bytes(value[10..14].try_into().map_err(|_| bad())?);
        let len = usize::try_from(len).map_err(|_| bad())?;
        let rest = &value[Self::HEADER..];
        if rest.len() < len {
            return Err(bad());
        }
        Ok(Stored {
            done,
            orphan,
            token,
            fingerprint: Bytes::copy_from_slice(&rest[..len]),
            data: Bytes::copy_from_slice(&rest[len..]),
        })
    }

    fn completed(&self) -> Option<Record> {
        self.done.then(|| {
            Record::new(
                FencingToken::new(self.token),
                self.fingerprint.clone(),
                self.data.clone(),
            )
        })
    }
}

fn percent_decode(s: &str) -> Result<String, ConfigError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let byte = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| ConfigError::new("bad percent-encoding in etcd URL"))?;
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| ConfigError::new("etcd URL component is not UTF-8"))
}

impl Node for EtcdNode {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn check_locker(&self, ttl: Duration, nodes: usize) -> Result<(), ConfigError> {
        EtcdNode::check(ttl, nodes)
    }

    fn acquire(&self, request: &AcquireRequest<'_>) -> NodeFuture<AcquireReply> {
        let inner = self.inner.clone();
        let (keys, owner) = (request.keys.clone(), request.owner.clone());
        let (ttl, fencing) = (request.ttl, request.fencing);
        Box::pin(async move {
            pinned!(inner, |client| inner.acquire(
                client,
                keys.clone(),
                owner.clone(),
                ttl,
                fencing
            ))
        })
    }

    fn extend(&self, keys: &LockKeys, owner: &Owner, _ttl: Duration) -> NodeFuture<bool> {
        // The ttl is the locker's, the one the lease was granted with: a keep-alive
        // restores exactly it.
        let inner = self.inner.clone();
        let (keys, owner) = (keys.clone(), owner.clone());
        Box::pin(async move {
            pinned!(inner, |client| inner.extend(
                client,
                keys.clone(),
                owner.clone()
            ))
        })
    }

    fn release(&self, keys: &LockKeys, owner: &Owner) -> NodeFuture<bool> {
        let inner = self.inner.clone();
        let (keys, owner) = (keys.clone(), owner.clone());
        Box::pin(async move {
            pinned!(inner, |client| inner.release(
                client,
                keys.clone(),
                owner.clone()
            ))
        })
    }

    fn raise_fence(&self, _keys: &LockKeys, _token: u64, _fence_ttl: Duration) -> NodeFuture<()> {
        // The revision is the token; nothing can or need be raised. A locker with an
        // etcd node has no other node, so the engine never asks.
        Box::pin(std::future::ready(Ok(())))
    }

    fn subscribe(&self, keys: &LockKeys) -> NodeFuture<ReleaseSignal> {
        let inner = self.inner.clone();
        let keys = keys.clone();
        Box::pin(async move { pinned!(inner, |client| inner.subscribe(client, keys.clone())) })
    }

    fn records(&self) -> Option<&dyn RecordStore> {
        Some(self)
    }
}

impl RecordStore for EtcdNode {
    fn read_record(&self, keys: &LockKeys) -> NodeFuture<Option<Record>> {
        let inner = self.inner.clone();
        let keys = keys.clone();
        Box::pin(async move { pinned!(inner, |client| inner.read_record(client, keys.clone())) })
    }

    fn claim_record(&self, request: &ClaimRequest<'_>) -> NodeFuture<ClaimReply> {
        let inner = self.inner.clone();
        let keys = request.keys.clone();
        let owner = request.owner.clone();
        let token = request.token;
        let fingerprint = Bytes::copy_from_slice(request.fingerprint);
        let (pending_ttl, orphan_ttl) = (request.pending_ttl, request.orphan_ttl);
        Box::pin(async move {
            pinned!(inner, |client| inner.claim_record(
                client,
                keys.clone(),
                owner.clone(),
                (token, fingerprint.clone()),
                (pending_ttl, orphan_ttl)
            ))
        })
    }

    fn store_record(&self, request: &StoreRequest<'_>) -> NodeFuture<StoreReply> {
        let inner = self.inner.clone();
        let keys = request.keys.clone();
        let owner = request.owner.clone();
        let record = request.record.clone();
        let retention = request.retention;
        Box::pin(async move {
            pinned!(inner, |client| inner.store_record(
                client,
                keys.clone(),
                owner.clone(),
                record.clone(),
                retention
            ))
        })
    }

    fn discard_record(&self, keys: &LockKeys, token: u64) -> NodeFuture<bool> {
        let inner = self.inner.clone();
        let keys = keys.clone();
        Box::pin(async move {
            pinned!(inner, |client| inner.discard_record(
                client,
                keys.clone(),
                token
            ))
        })
    }
}

impl std::fmt::Debug for EtcdNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdNode")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_garbage_is_an_error() {
        let stored = Stored {
            done: true,
            orphan: false,
            token: 42,
            fingerprint: Bytes::from_static(b"fp"),
            data: Bytes::from_static(b"data"),
        };
        assert!(Stored::decode(&stored.encode()).unwrap() == stored);
        assert!(Stored::decode(b"").is_err());
        assert!(Stored::decode(b"x\0\0\0\0\0\0\0\0\0\0\0\0\0").is_err());
        let mut short = stored.encode();
        short.truncate(Stored::HEADER + 1);
        assert!(Stored::decode(&short).is_err());
    }

    #[test]
    fn urls_and_ttls() {
        let node =
            EtcdNode::from_url("etcd://u:p%40ss@127.0.0.1:2379,127.0.0.1:22379/app").unwrap();
        assert_eq!(node.name(), "etcd://127.0.0.1:2379,127.0.0.1:22379/app/");
        assert_eq!(node.inner.prefix, b"app/");
        assert_eq!(node.inner.user, Some(("u".to_owned(), "p@ss".to_owned())));
        assert_eq!(EtcdNode::from_url("etcd://h:1").unwrap().inner.prefix, b"");
        for (url, says) in [
            ("etcd://", "endpoint"),
            ("etcd://h", "host:port"),
            ("etcd://h:1,,h:2", "endpoint"),
            ("etcd://h:x", "host:port"),
            ("etcd://h:1?x=1", "no query"),
            ("etcd://user@h:1", "user:password"),
            ("redis://h:1", "etcd://"),
        ] {
            let err = EtcdNode::from_url(url)
                .map(|_| ())
                .expect_err(url)
                .to_string();
            assert!(err.contains(says), "{url}: {err}");
        }
        assert_eq!(whole_seconds(Duration::from_millis(1)), 1);
        assert_eq!(whole_seconds(Duration::from_millis(2001)), 3);
        assert_eq!(whole_seconds(Duration::from_secs(5)), 5);
        let ok = Duration::from_secs(2);
        assert!(EtcdNode::check(ok, 1).is_ok());
        for (ttl, nodes, says) in [
            (Duration::from_millis(2500), 1, "whole seconds"),
            (Duration::from_secs(1), 1, "minimum"),
            (ok, 3, "only node"),
        ] {
            let err = EtcdNode::check(ttl, nodes).unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
    }
}
