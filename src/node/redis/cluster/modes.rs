//! [`SharedModes`] of a [`ClusterNode`]: the shared holders' scripts (`call::modes`),
//! routed by the lock key. Every key they touch carries the resource's hash tag (see
//! [`LockKeys`]), so one master runs each whole; wake-ups go out with `SPUBLISH`.

use std::time::Duration;

use super::{node_error, ClusterNode};
use crate::node::redis::call::modes::{
    self, SharedAcquireCall, SharedExtendCall, SharedReleaseCall,
};
use crate::node::redis::line::in_turn;
use crate::node::{AcquireReply, LockKeys, NodeFuture, Owner, SharedModes, SharedRequest};

impl SharedModes for ClusterNode {
    fn acquire_shared(&self, request: &SharedRequest<'_>) -> NodeFuture<AcquireReply> {
        let call = SharedAcquireCall::new(request);
        let (inner, wait) = (self.inner.clone(), self.wait);
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, modes::acquire_shared(&mut conn, &call, wait))
                .await
                .map_err(node_error)
        })
    }

    fn extend_shared(&self, keys: &LockKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        let call = SharedExtendCall::new(keys, owner, ttl);
        let (inner, wait) = (self.inner.clone(), self.wait);
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, modes::extend_shared(&mut conn, &call, wait))
                .await
                .map_err(node_error)
        })
    }

    fn release_shared(&self, keys: &LockKeys, owner: &Owner) -> NodeFuture<bool> {
        let call = SharedReleaseCall::new(keys, owner, true);
        let inner = self.inner.clone();
        Box::pin(async move {
            let (mut conn, place) = inner.connection().await?;
            in_turn(place, modes::release_shared(&mut conn, &call))
                .await
                .map_err(node_error)
        })
    }
}
