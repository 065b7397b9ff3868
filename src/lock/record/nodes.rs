//! The node side of the record protocol: writing a record to every node under a
//! lease, and what a node without records answers.

use super::*;

/// Writes `record`, found on some nodes, to every node under this lease (as a store:
/// a node holding it already, or a newer one, keeps what it has). Best effort: a node
/// that misses it is written back by a later claim.
pub(super) async fn write_back(inner: &LeaseInner, record: &Record, ttl: Duration) {
    let mut written = 0;
    store_on_nodes(inner, record, ttl, |_, answer, pending| {
        written += usize::from(matches!(answer, Ok(StoreReply::Stored)));
        pending == 0
    })
    .await;
    tracing::debug!(resource = %inner.resource(), token = %record.token(), holding = written, "outcome record written back to the nodes");
}

/// `record` sent to every node under this lease's owner value, within its validity;
/// each answer goes to `decided` (the node, the answer, the calls still pending), which
/// says when the outcome is known.
pub(super) async fn store_on_nodes(
    inner: &LeaseInner,
    record: &Record,
    retention: Duration,
    decided: impl FnMut(usize, Result<StoreReply, NodeError>, usize) -> bool,
) {
    let nodes = &inner.locker.nodes;
    let request = StoreRequest {
        keys: &inner.lock_keys()[0],
        owner: &inner.owner,
        record,
        retention: record_ttl(retention),
    };
    let call = |index, node: &dyn Node| {
        let owner = inner.owner.for_node(index);
        records_of(node).store_record(&StoreRequest {
            owner: &owner,
            ..request
        })
    };
    let timeout = bounded_by_validity(inner);
    nodes.fan_out(0..nodes.len(), timeout, call, decided).await;
}

/// [`Lease::discard_record`], for a future that owns what it needs.
pub(crate) async fn discard_owned(handle: LeaseHandle) -> Result<(), LockError> {
    let inner = handle.lease_inner();
    let nodes = &inner.locker.nodes;
    let quorum = nodes.quorum();
    let token = inner.token().get();
    let mut answered = 0;
    let mut failures = Vec::new();
    nodes
        .fan_out(
            0..nodes.len(),
            nodes.timeout(),
            |_, node| records_of(node).discard_record(&inner.lock_keys()[0], token),
            |index, answer, pending| {
                match answer {
                    Ok(_) => answered += 1,
                    Err(error) => failures.push(nodes.failure(index, error)),
                }
                quorum::count_decided(quorum, answered, pending)
            },
        )
        .await;
    if answered >= quorum {
        Ok(())
    } else {
        Err(nodes.unavailable(inner.resource(), answered, quorum, failures))
    }
}

/// Removes our pending marker everywhere, without waiting for the answers.
pub(super) fn discard_in_background(inner: &LeaseInner) {
    let nodes = &inner.locker.nodes;
    let token = inner.token().get();
    let calls: Vec<_> = nodes
        .each()
        .map(|node| {
            let call = records_of(node.as_ref()).discard_record(&inner.lock_keys()[0], token);
            tokio::time::timeout(nodes.timeout(), call)
        })
        .collect();
    metrics::spawn(&inner.locker.runtime, async move {
        futures_util::future::join_all(calls).await;
    });
}

/// A node's records, or one that answers [`NodeError::Unsupported`] to everything: a
/// locker built without checking ([`Redlock::check_records`]) counts such a node as
/// one that does not answer, as it would count a node that is down.
pub(super) fn records_of(node: &dyn Node) -> &dyn RecordStore {
    node.records().unwrap_or(&NoRecords)
}

struct NoRecords;

impl RecordStore for NoRecords {
    fn read_record(&self, _: &ResourceKeys) -> NodeFuture<Option<Record>> {
        Box::pin(std::future::ready(Err(unsupported())))
    }

    fn claim_record(&self, _: &ClaimRequest<'_>) -> NodeFuture<ClaimReply> {
        Box::pin(std::future::ready(Err(unsupported())))
    }

    fn store_record(&self, _: &StoreRequest<'_>) -> NodeFuture<StoreReply> {
        Box::pin(std::future::ready(Err(unsupported())))
    }

    fn discard_record(&self, _: &ResourceKeys, _: u64) -> NodeFuture<bool> {
        Box::pin(std::future::ready(Err(unsupported())))
    }
}

/// The per-node timeout, cut to the lease's remaining validity.
pub(super) fn bounded_by_validity(inner: &LeaseInner) -> Duration {
    let left = inner
        .status()
        .valid_until
        .saturating_duration_since(Instant::now());
    inner.locker.nodes.timeout().min(left)
}
