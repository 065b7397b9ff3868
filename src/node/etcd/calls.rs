//! The etcd calls behind [`EtcdNode`](super::EtcdNode): lock and record transactions,
//! leases, watches, and the mapping of etcd errors.

use super::*;

impl Inner {
    /// The pinned member's index and its client.
    pub(super) async fn pinned(&self) -> Result<(usize, Client), NodeError> {
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

    pub(super) fn key(&self, key: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.prefix.len() + key.len());
        out.extend_from_slice(&self.prefix);
        out.extend_from_slice(key.as_bytes());
        out
    }

    pub(super) async fn subscribe(
        &self,
        mut client: Client,
        keys: ResourceKeys,
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

    pub(super) async fn read_record(
        &self,
        mut client: Client,
        keys: ResourceKeys,
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
    pub(super) async fn claim_record(
        &self,
        mut client: Client,
        keys: ResourceKeys,
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
                        Some(ttl) => grant(&mut client, ttl).await?,
                        None => *lease,
                    };
                    (Some((orphaned, lease)), Some(lease))
                }
                None => {
                    let lease = grant(&mut client, pending_ttl).await?;
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
                // Only a marker written on a lease of its own frees the old one: a
                // claim that wrote nothing (sent again, or the marker already orphaned)
                // keeps it, or revoking it would delete the marker.
                Guarded::Written => {
                    if let (Some(new), Some(old)) = (new_lease, old_lease)
                        && new != old
                    {
                        revoke_in_background(&client, old);
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

    pub(super) async fn store_record(
        &self,
        mut client: Client,
        keys: ResourceKeys,
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
                    let lease = grant(&mut client, retention).await?;
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

    pub(super) async fn discard_record(
        &self,
        mut client: Client,
        keys: ResourceKeys,
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
pub(super) enum Guarded {
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
pub(super) async fn guarded_write(
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
pub(super) async fn read_stored(
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

/// The key-value of a transaction's range answer: value, lease and create revision.
pub(super) fn kv_of(op: TxnOpResponse) -> Option<(Vec<u8>, i64, i64)> {
    match op {
        TxnOpResponse::Get(get) => get
            .kvs()
            .first()
            .map(|kv| (kv.value().to_vec(), kv.lease(), kv.create_revision())),
        _ => None,
    }
}

/// The key-value of the first range answer of a transaction.
pub(super) fn first_kv(reply: &TxnResponse) -> Option<(Vec<u8>, i64, i64)> {
    reply.op_responses().into_iter().find_map(kv_of)
}

/// A new lease of `ttl` (whole seconds, rounded up).
pub(super) async fn grant(client: &mut Client, ttl: Duration) -> Result<i64, NodeError> {
    let reply = client.lease_grant(whole_seconds(ttl), None).await;
    Ok(reply.map_err(node_error)?.id())
}

pub(super) async fn lease_ttl(client: &mut Client, lease: i64) -> Result<Duration, NodeError> {
    let reply = client
        .lease_time_to_live(lease, None)
        .await
        .map_err(node_error)?;
    // etcd answers -1 for a lease that expired in between: free now.
    Ok(Duration::from_secs(u64::try_from(reply.ttl()).unwrap_or(0)))
}

pub(super) fn revoke_in_background(client: &Client, lease: i64) {
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
pub(super) fn whole_seconds(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
}

pub(super) fn node_error(error: etcd_client::Error) -> NodeError {
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

pub(super) fn busy() -> NodeError {
    NodeError::Server("the record key kept changing under concurrent writers".into())
}

pub(super) struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
