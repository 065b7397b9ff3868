//! [`SharedModes`] of a [`SentinelNode`]: the shared holders' scripts (`call::modes`) on
//! the current master's connection, as its other calls.

use std::time::Duration;

use super::SentinelNode;
use crate::node::redis::call::modes::{
    self, SharedAcquireCall, SharedExtendCall, SharedReleaseCall,
};
use crate::node::{AcquireReply, LockKeys, NodeFuture, Owner, SharedModes, SharedRequest};

impl SharedModes for SentinelNode {
    fn acquire_shared(&self, request: &SharedRequest<'_>) -> NodeFuture<AcquireReply> {
        let call = SharedAcquireCall::new(request);
        let (inner, wait) = (self.inner.clone(), self.wait);
        Box::pin(async move {
            let call = &call;
            inner
                .with_master(|mut conn| async move {
                    modes::acquire_shared(&mut conn, call, wait).await
                })
                .await
        })
    }

    fn extend_shared(&self, keys: &LockKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        let call = SharedExtendCall::new(keys, owner, ttl);
        let (inner, wait) = (self.inner.clone(), self.wait);
        Box::pin(async move {
            let call = &call;
            inner
                .with_master(
                    |mut conn| async move { modes::extend_shared(&mut conn, call, wait).await },
                )
                .await
        })
    }

    fn release_shared(&self, keys: &LockKeys, owner: &Owner) -> NodeFuture<bool> {
        let call = SharedReleaseCall::new(keys, owner, false);
        let inner = self.inner.clone();
        Box::pin(async move {
            let call = &call;
            inner
                .with_master(|mut conn| async move { modes::release_shared(&mut conn, call).await })
                .await
        })
    }
}
