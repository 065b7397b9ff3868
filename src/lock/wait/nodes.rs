//! What waiting asks of every node: leaving the queues, subscribing to releases,
//! marking the queues listened to.

use super::*;

impl Nodes {
    /// Takes `waiter` out of the wait queue of every node that keeps one, in the
    /// background, each call bounded by the node timeout. The calls are made here: a
    /// node may act when called.
    pub(crate) fn leave_all(&self, keys: &ResourceKeys, waiter: &Waiter) {
        let timeout = self.timeout();
        let calls: FuturesUnordered<_> = self
            .each()
            .filter(|node| node.capabilities().wait_queue)
            .map(|node| tokio::time::timeout(timeout, node.leave_queue(keys, waiter)))
            .collect();
        if !calls.is_empty() {
            tokio::spawn(calls.for_each(|_| async {}));
        }
    }

    /// Subscribes to each member's own channel on every node, the nodes concurrently,
    /// the members one after the other (the broadcast wake-up: what waiting for a set
    /// of resources uses); nodes that fail or time out are left out.
    pub(crate) async fn subscribe_broadcast(&self, members: &[ResourceKeys]) -> Vec<ReleaseSignal> {
        let timeout = self.timeout();
        let mut signals = Vec::new();
        for keys in members {
            let calls: FuturesUnordered<_> = self
                .each()
                .map(|node| tokio::time::timeout(timeout, node.subscribe(keys)))
                .collect();
            let answers =
                calls.filter_map(|answer| async move { answer.ok().and_then(Result::ok) });
            signals.extend(answers.collect::<Vec<_>>().await);
        }
        signals
    }

    /// Marks every member's wait queue as listened to, on every node, concurrently (see
    /// [`Node::listen_for_release`](crate::node::Node::listen_for_release)), for
    /// [`QUEUE_TTL`]; nodes that fail or time out are left out (the retry timer covers
    /// them).
    pub(crate) async fn listen_for_release(&self, members: &[ResourceKeys]) {
        let timeout = self.timeout();
        let calls: FuturesUnordered<_> = members
            .iter()
            .flat_map(|keys| {
                self.each().map(move |node| {
                    tokio::time::timeout(timeout, node.listen_for_release(keys, QUEUE_TTL))
                })
            })
            .collect();
        calls.for_each(|_| async {}).await;
    }

    /// Subscribes to the waiter's own channel on every node that keeps a wait queue,
    /// and to the resource's channel on the others, concurrently; nodes that fail or
    /// time out are left out (the fallback retry covers them).
    pub(crate) async fn subscribe_all(
        &self,
        keys: &ResourceKeys,
        waiter: &Waiter,
    ) -> Vec<ReleaseSignal> {
        let timeout = self.timeout();
        let own = ResourceKeys {
            channel: waiter.channel(keys),
            ..keys.clone()
        };
        let calls: FuturesUnordered<_> = self
            .each()
            .map(|node| {
                let keys = if node.capabilities().wait_queue {
                    &own
                } else {
                    keys
                };
                tokio::time::timeout(timeout, node.subscribe(keys))
            })
            .collect();
        calls
            .filter_map(|answer| async move { answer.ok().and_then(Result::ok) })
            .collect()
            .await
    }
}
