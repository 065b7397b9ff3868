//! The outcome records (idempotent replay) of a [`SentinelNode`].

use crate::node::redis::records;
use crate::node::LockKeys;
use crate::node::NodeFuture;
use crate::node::{ClaimReply, ClaimRequest, Record, RecordStore, StoreReply, StoreRequest};

use super::SentinelNode;

impl RecordStore for SentinelNode {
    // Outcome records (idempotent replay): the commands are those of the standalone
    // node (`records.rs`), on the current master, followed across failovers like
    // the lock commands. Claims and stores honour `wait_for_replicas`: a record counts
    // only once the replicas a failover may promote have it.
    fn read_record(&self, keys: &LockKeys) -> NodeFuture<Option<Record>> {
        let keys = keys.clone();
        let inner = self.inner.clone();
        Box::pin(async move {
            let keys = &keys;
            inner
                .with_master(|mut conn| async move { records::read(&mut conn, keys).await })
                .await
        })
    }

    fn claim_record(&self, request: &ClaimRequest<'_>) -> NodeFuture<ClaimReply> {
        let call = records::ClaimCall::new(request);
        let inner = self.inner.clone();
        let wait = self.wait;
        Box::pin(async move {
            let call = &call;
            inner
                .with_master(|mut conn| async move { records::claim(&mut conn, call, wait).await })
                .await
        })
    }

    fn store_record(&self, request: &StoreRequest<'_>) -> NodeFuture<StoreReply> {
        let call = records::StoreCall::new(request);
        let inner = self.inner.clone();
        let wait = self.wait;
        Box::pin(async move {
            let call = &call;
            inner
                .with_master(|mut conn| async move { records::store(&mut conn, call, wait).await })
                .await
        })
    }

    fn discard_record(&self, keys: &LockKeys, token: u64) -> NodeFuture<bool> {
        let call = records::DiscardCall::new(keys, token);
        let inner = self.inner.clone();
        Box::pin(async move {
            let call = &call;
            inner
                .with_master(|mut conn| async move { records::discard(&mut conn, call).await })
                .await
        })
    }
}
