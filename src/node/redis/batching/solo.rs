//! A command that goes out on its own, without a batch, where a batch of one would
//! change nothing but its cost.

use super::*;

/// A command (or a caller's pipeline) that goes out on its own because nothing of its
/// node is in flight and no batch is open: what a batch of one would do (sent at once,
/// counted in `in_flight` so that the next caller yields and gathers a batch behind it),
/// without the batch (its shared state, the copy of the command, the pipeline around
/// it: many of the allocator calls of a sequential acquire + release on one node,
/// `benches/memory.rs`, BENCHMARKS.md).
pub(super) struct Solo<'a> {
    node: &'a NodeBatches,
}

impl<'a> Solo<'a> {
    /// Sends what `make` makes, alone, if nothing of `node` is in flight and no batch is
    /// open (then the reply); otherwise `None`, and the caller joins a batch. As a
    /// batch's, the first poll is made under the node's lock, so that no later batch
    /// reaches the connection first.
    pub(super) async fn start<T>(
        node: &'a NodeBatches,
        make: impl FnOnce() -> Pin<Box<dyn Future<Output = T> + Send + 'a>>,
    ) -> Option<T> {
        let mut make = Some(make);
        let busy = || node.in_flight.load(Ordering::Acquire) > 0;
        let started = poll_fn(|cx| {
            // Under load something is nearly always in flight: the caller goes to a
            // batch without taking the node's lock twice (here and to join).
            if busy() {
                return Poll::Ready(None);
            }
            let open = lock(&node.open);
            let make = make.take().expect("polled once");
            if open.is_some() || busy() {
                return Poll::Ready(None);
            }
            node.in_flight.fetch_add(1, Ordering::AcqRel);
            let counted = Solo { node };
            let mut send = make();
            let first = send.as_mut().poll(cx);
            drop(open);
            Poll::Ready(Some((counted, send, first)))
        })
        .await;
        let (_counted, send, first) = started?;
        Some(match first {
            Poll::Ready(reply) => reply,
            Poll::Pending => send.await,
        })
    }
}

impl Drop for Solo<'_> {
    /// Answered, or dropped (its reply left unread, as redis-rs leaves it).
    fn drop(&mut self) {
        self.node.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A send that goes out on its own (unbatched), boxed: redis-rs's send future is large,
/// and held inline it made every node call's boxed future too large for the
/// allocator's fast path (BENCHMARKS.md; `standalone.rs` tests the size).
pub(super) fn alone<'a, T>(
    send: impl Future<Output = T> + Send + 'a,
) -> Pin<Box<dyn Future<Output = T> + Send + 'a>> {
    Box::pin(send)
}
