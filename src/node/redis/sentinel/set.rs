//! The set calls of a [`SentinelNode`]: one script each, on the current master.

use crate::node::redis::call::set::SetCall;
use crate::node::NodeFuture;

use super::SentinelNode;

impl SentinelNode {
    pub(super) fn run_set<T: Send + 'static>(&self, call: SetCall<T>) -> NodeFuture<T> {
        let inner = self.inner.clone();
        let wait = self.wait;
        Box::pin(async move {
            let call = &call;
            inner
                .with_master(|mut conn| async move { call.run(&mut conn, wait).await })
                .await
        })
    }
}
