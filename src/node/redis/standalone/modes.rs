//! [`SharedModes`] of a [`RedisNode`]: the shared holders' scripts (`call::modes`) on
//! the node's command connection.

use std::time::Duration;

use super::RedisNode;
use crate::node::redis::call::modes::{
    self, SharedAcquireCall, SharedExtendCall, SharedReleaseCall,
};
use crate::node::{AcquireReply, LockKeys, NodeFuture, Owner, SharedModes, SharedRequest};

impl SharedModes for RedisNode {
    fn acquire_shared(&self, request: &SharedRequest<'_>) -> NodeFuture<AcquireReply> {
        let call = SharedAcquireCall::new(request);
        self.run(move |mut conn, wait| async move {
            modes::acquire_shared(&mut conn, &call, wait).await
        })
    }

    fn extend_shared(&self, keys: &LockKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        let call = SharedExtendCall::new(keys, owner, ttl);
        self.run(
            move |mut conn, wait| async move { modes::extend_shared(&mut conn, &call, wait).await },
        )
    }

    fn release_shared(&self, keys: &LockKeys, owner: &Owner) -> NodeFuture<bool> {
        let call = SharedReleaseCall::new(keys, owner, false);
        self.run(move |mut conn, _| async move { modes::release_shared(&mut conn, &call).await })
    }
}
