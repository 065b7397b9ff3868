//! [`EtcdNode`](super::EtcdNode)'s [`Node`] and [`RecordStore`] impls, and its lock
//! calls: one transaction for one resource or a whole set (a set of one is one
//! resource).
//!
//! The members share one etcd lease, drawn for this acquisition alone: a keep-alive of
//! it renews every member, and revoking it deletes whatever member is left.

use super::*;

impl Inner {
    /// Grants a lease, then one transaction: `if create_revision(key) == 0` for every
    /// member `then put(key, owner, lease)` for every member `else get(key)` for each.
    /// Every member's token is the transaction's revision (as one key's is).
    pub(super) async fn acquire(
        &self,
        mut client: Client,
        keys: Arc<[ResourceKeys]>,
        owner: Owner,
        ttl: Duration,
        fencing: bool,
    ) -> Result<Vote, NodeError> {
        let names: Vec<Vec<u8>> = keys.iter().map(|k| self.key(&k.lock)).collect();
        let lease = grant(&mut client, ttl).await?;
        let put = PutOptions::new().with_lease(lease);
        let txn = Txn::new()
            .when(
                names
                    .iter()
                    .map(|key| Compare::create_revision(key.clone(), CompareOp::Equal, 0))
                    .collect::<Vec<_>>(),
            )
            .and_then(
                names
                    .iter()
                    .map(|key| TxnOp::put(key.clone(), owner.as_str(), Some(put.clone())))
                    .collect::<Vec<_>>(),
            )
            .or_else(
                names
                    .iter()
                    .map(|key| TxnOp::get(key.clone(), None))
                    .collect::<Vec<_>>(),
            );
        // On an error the puts may have landed: the locker's cleanup deletes the keys by
        // owner and revokes their lease. Otherwise the lease expires with its ttl.
        let reply = client.txn(txn).await.map_err(node_error)?;
        let token = |revision: i64| {
            u64::try_from(revision)
                .ok()
                .filter(|&r| r > 0)
                .ok_or_else(|| NodeError::Protocol("etcd answered without a revision".into()))
        };
        if reply.succeeded() {
            let fence = token(reply.header().map_or(0, |h| h.revision()))?;
            let fence = if fencing { fence } else { 0 };
            return Ok(Vote::Granted {
                fences: PerKey::map(&names, |_| fence),
            });
        }
        revoke_in_background(&client, lease);
        // Each member's holder, in the request's order (`None`: free).
        let holders: Vec<_> = reply.op_responses().into_iter().map(kv_of).collect();
        let ours = |holder: &Option<(Vec<u8>, i64, i64)>| {
            holder
                .as_ref()
                .is_some_and(|(value, ..)| value.as_slice() == owner.as_str().as_bytes())
        };
        if holders.len() == names.len() && holders.iter().all(ours) {
            // Our own keys: an earlier run of this very acquire landed (its answer was
            // lost with the connection). Acquired, with that run's revision.
            let created = holders[0].as_ref().map_or(0, |(_, _, created)| *created);
            let fence = if fencing { token(created)? } else { 0 };
            return Ok(Vote::Granted {
                fences: PerKey::map(&names, |_| fence),
            });
        }
        // Held by someone else (a member's key exists and is not ours). A member of our
        // own among them cannot be: a set is put whole or not at all.
        let Some(member) = holders.iter().position(|h| h.is_some() && !ours(h)) else {
            // Every key vanished between the compare and the get (they cannot, in one
            // transaction): nothing to tell but that it was held.
            return Ok(Vote::Held {
                member: 0,
                pttl: None,
            });
        };
        let pttl = match holders[member].as_ref().map(|(_, lease, _)| *lease) {
            Some(lease) if lease != 0 => Some(lease_ttl(&mut client, lease).await?),
            _ => None,
        };
        Ok(Vote::Held { member, pttl })
    }

    /// `if value(key) == owner` for every member `then get(first key)`, and with
    /// `delete` delete every member.
    fn if_owned(&self, keys: &[ResourceKeys], owner: &Owner, delete: bool) -> Txn {
        let names: Vec<Vec<u8>> = keys.iter().map(|k| self.key(&k.lock)).collect();
        let owned: Vec<_> = names
            .iter()
            .map(|key| Compare::value(key.clone(), CompareOp::Equal, owner.as_str()))
            .collect();
        let deletes = names.iter().filter(|_| delete);
        let get = TxnOp::get(names[0].clone(), None);
        let then = std::iter::once(get).chain(deletes.map(|key| TxnOp::delete(key.clone(), None)));
        Txn::new().when(owned).and_then(then.collect::<Vec<_>>())
    }

    /// [`if_owned`](Self::if_owned), then one keep-alive of the set's lease.
    pub(super) async fn extend(
        &self,
        mut client: Client,
        keys: Arc<[ResourceKeys]>,
        owner: Owner,
    ) -> Result<bool, NodeError> {
        let txn = self.if_owned(&keys, &owner, false);
        let reply = client.txn(txn).await.map_err(node_error)?;
        let Some((_, lease, _)) = reply.succeeded().then(|| first_kv(&reply)).flatten() else {
            return Ok(false);
        };
        match client.lease_keep_alive(lease).await {
            Ok(_) => Ok(true),
            Err(etcd_client::Error::LeaseKeepAliveError(_)) => Ok(false),
            Err(e) => Err(node_error(e)),
        }
    }

    /// [`if_owned`](Self::if_owned) deleting every member, then revoke the set's lease.
    /// When some member is no longer ours, the members still ours are released one by
    /// one and the answer is no.
    pub(super) async fn release_all(
        &self,
        mut client: Client,
        keys: Arc<[ResourceKeys]>,
        owner: Owner,
    ) -> Result<bool, NodeError> {
        if self.release(&mut client, &keys, &owner).await? {
            return Ok(true);
        }
        for member in keys.iter() {
            self.release(&mut client, std::slice::from_ref(member), &owner)
                .await?;
        }
        Ok(false)
    }

    async fn release(
        &self,
        client: &mut Client,
        keys: &[ResourceKeys],
        owner: &Owner,
    ) -> Result<bool, NodeError> {
        let reply = client.txn(self.if_owned(keys, owner, true)).await;
        let reply = reply.map_err(node_error)?;
        if !reply.succeeded() {
            return Ok(false);
        }
        if let Some((_, lease, _)) = first_kv(&reply) {
            // The keys are gone already; the lease holds nothing else. Revoking it only
            // tidies up, so a failure here does not undo the release.
            let _ = client.lease_revoke(lease).await;
        }
        Ok(true)
    }
}

impl Node for EtcdNode {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn check_locker(&self, ttl: Duration, nodes: usize) -> Result<(), ConfigError> {
        EtcdNode::check(ttl, nodes)
    }

    /// One transaction, one resource or a set (the members on one lease, `set.rs`);
    /// exclusive only (the node has no shared holders).
    fn acquire(&self, request: &Acquire<'_>) -> NodeFuture<Vote> {
        let (keys, owner): (Arc<[ResourceKeys]>, _) = (request.keys.into(), request.owner.clone());
        let (ttl, fencing) = (request.ttl, request.fencing);
        if !request.mode.is_exclusive() {
            return Box::pin(std::future::ready(Err(NodeError::Unsupported(
                "shared and counted leases".into(),
            ))));
        }
        pinned!(self, acquire(keys, owner; ttl, fencing))
    }

    fn extend(
        &self,
        holds: &[Hold<'_>],
        _ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
        // The ttl is the locker's, the one the lease was granted with: a keep-alive
        // restores exactly it.
        let calls: Vec<_> = holds
            .iter()
            .map(|hold| {
                let (keys, owner): (Arc<[ResourceKeys]>, _) =
                    (hold.keys.into(), hold.owner.clone());
                pinned!(self, extend(keys, owner;))
            })
            .collect();
        Box::pin(async move { Ok(futures_util::future::join_all(calls).await) })
    }

    fn release(&self, hold: &Hold<'_>, _how: Release<'_>) -> NodeFuture<bool> {
        // Without a wait queue every release is the same: the watchers of each key see
        // it deleted.
        let (keys, owner): (Arc<[ResourceKeys]>, _) = (hold.keys.into(), hold.owner.clone());
        pinned!(self, release_all(keys, owner;))
    }

    fn raise_fences(
        &self,
        _keys: &[ResourceKeys],
        _tokens: &[u64],
        _ttl: Duration,
    ) -> NodeFuture<()> {
        // The revision is the token; nothing can or need be raised. A locker with an
        // etcd node has no other node, so the engine never asks.
        Box::pin(std::future::ready(Ok(())))
    }

    fn subscribe(&self, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
        let keys = keys.clone();
        pinned!(self, subscribe(keys;))
    }

    fn records(&self) -> Option<&dyn RecordStore> {
        Some(self)
    }
}

impl RecordStore for EtcdNode {
    fn read_record(&self, keys: &ResourceKeys) -> NodeFuture<Option<Record>> {
        let keys = keys.clone();
        pinned!(self, read_record(keys;))
    }

    fn claim_record(&self, request: &ClaimRequest<'_>) -> NodeFuture<ClaimReply> {
        let (keys, owner) = (request.keys.clone(), request.owner.clone());
        let marker = (request.token, Bytes::copy_from_slice(request.fingerprint));
        let ttls = (request.pending_ttl, request.orphan_ttl);
        pinned!(self, claim_record(keys, owner, marker; ttls))
    }

    fn store_record(&self, request: &StoreRequest<'_>) -> NodeFuture<StoreReply> {
        let (keys, owner) = (request.keys.clone(), request.owner.clone());
        let (record, retention) = (request.record.clone(), request.retention);
        pinned!(self, store_record(keys, owner, record; retention))
    }

    fn discard_record(&self, keys: &ResourceKeys, token: u64) -> NodeFuture<bool> {
        let keys = keys.clone();
        pinned!(self, discard_record(keys; token))
    }
}
