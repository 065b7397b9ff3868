//! One renewal round: a batch of leases extended with one call per node, each lease
//! decided as a watchdog of its own would decide it.

use super::*;

/// One extend round for a batch of leases: one batched call per node, decided once
/// every lease of the batch is (a majority extended it, or said its key is gone, or
/// neither can happen any more).
pub(super) fn extend(locker: Arc<Shared>, leases: Vec<(u64, Arc<LeaseInner>)>) -> Round {
    Box::pin(async move {
        let nodes = &locker.nodes;
        let quorums: Vec<usize> = leases.iter().map(|(_, inner)| inner.quorum()).collect();
        let ttl = locker.options.ttl;
        let start = Instant::now();
        // No lease may be reported renewed past its deadline: the round ends there.
        let deadline = leases
            .iter()
            .map(|(_, inner)| inner.status().valid_until)
            .min()
            .unwrap_or(start);
        // A batch is many commands on one connection: each node gets the node timeout
        // per `KEYS_PER_TIMEOUT` keys (the validity counts from `start` whenever the
        // answer comes, so waiting longer is safe), never past the first deadline.
        let keys: usize = leases
            .iter()
            .map(|(_, inner)| inner.lock_keys().len())
            .sum();
        let per_keys = u32::try_from(keys.div_ceil(KEYS_PER_TIMEOUT)).unwrap_or(u32::MAX);
        let timeout = nodes
            .timeout()
            .saturating_mul(per_keys.max(1))
            .min(deadline.saturating_duration_since(start));
        let mut tallies: Vec<OwnerTally> = std::iter::repeat_with(OwnerTally::default)
            .take(leases.len())
            .collect();
        // The calls still running once every lease is decided finish in the background:
        // every node that can answer gets every extend.
        nodes
            .fan_out(
                0..nodes.len(),
                timeout,
                |index, node| {
                    let owners: Vec<_> = leases
                        .iter()
                        .map(|(_, inner)| inner.owner.for_node(index))
                        .collect();
                    let holds: Vec<Hold<'_>> = leases
                        .iter()
                        .zip(&owners)
                        .map(|((_, inner), owner)| inner.target.hold(owner))
                        .collect();
                    node.extend(&holds, ttl)
                },
                |index, answer, pending| {
                    add_answers(&locker, &mut tallies, index, answer);
                    let decided = |(t, quorum): (&OwnerTally, &usize)| {
                        crate::lock::quorum::tally_decided(*quorum, t.yes, t.no, pending)
                    };
                    tallies.iter().zip(&quorums).all(decided)
                },
            )
            .await;
        apply(&locker, &leases, start, tallies);
    })
}

/// One node's answers to a batch, one per lease (a set's counts as extended only when
/// every member is).
fn add_answers(
    locker: &Shared,
    tallies: &mut [OwnerTally],
    index: usize,
    answer: Result<Vec<Result<bool, NodeError>>, NodeError>,
) {
    // A failed call is every lease's failure on that node.
    let mut answers = match answer {
        Ok(answers) => answers.into_iter(),
        Err(error) => vec![Err(error); tallies.len()].into_iter(),
    };
    for tally in tallies.iter_mut() {
        let answer = answers.next().unwrap_or_else(|| {
            Err(NodeError::Protocol(
                "fewer answers than leases to extend".into(),
            ))
        });
        tally.add(answer, || locker.nodes.name(index));
    }
}

/// Applies a round decided with `tallies` to each of its leases, and puts each back on
/// the schedule as its outcome says.
fn apply(
    locker: &Shared,
    leases: &[(u64, Arc<LeaseInner>)],
    start: Instant,
    tallies: Vec<OwnerTally>,
) {
    let options = &locker.options;
    // After a failed round, try again soon: the lease is only lost at the deadline.
    let retry_every =
        (options.ttl / 30).clamp(Duration::from_millis(10), Duration::from_millis(500));
    for ((id, inner), tally) in leases.iter().zip(tallies) {
        match inner.settle_extend(start, tally) {
            Ok(valid_until) => {
                let at = renew_at(locker, valid_until);
                schedule(locker, *id, inner, at, Kind::Renew);
            }
            Err(ExtendFailure::KeyLost) => {
                inner.mark_lost(LostCause::KeyLost);
                forget(locker, *id);
            }
            Err(ExtendFailure::NoQuorum) => {
                let deadline = inner.status().valid_until;
                let next = Instant::now() + retry_every;
                if next >= deadline {
                    schedule(
                        locker,
                        *id,
                        inner,
                        deadline,
                        Kind::Expire(LostCause::RenewalFailed),
                    );
                } else {
                    schedule(locker, *id, inner, next, Kind::Retry);
                }
            }
        }
    }
}
