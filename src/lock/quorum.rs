//! The quorum rule, written once: a majority of the nodes, and when the answers of a
//! round have decided its outcome. Acquisition (one resource or a set), its fence
//! write-back, release, extension, the renewal scheduler and the outcome records all
//! decide through here.
//!
//! Two majorities of `N` nodes always share a node, and one node grants a resource to
//! one owner at a time: so at most one owner can hold a majority of grants. That is the
//! whole safety argument of Redlock's exclusion (with validity accounting for time, see
//! [`fencing`](super::fencing) for the tokens); every decision below only stops
//! listening early, never counts a vote twice or a missing answer as a vote.

use crate::LockMode;

/// The number of votes that decides among `nodes` nodes: `nodes / 2 + 1`.
pub(crate) fn of(nodes: usize) -> usize {
    nodes / 2 + 1
}

/// The votes a lease in `mode` needs among `nodes` nodes: a majority ([`of`]), except
/// for a counted lease of `n` permits, which needs more than `nodes · n / (n + 1)`.
///
/// A majority is enough where a node admits one kind of holder at a time: an exclusive
/// lease and a writer's (two majorities share a node, which granted one of them only),
/// and a writer against readers (the node they share holds either). It is not enough
/// for permits: a node admits `n` holders, and `n + 1` holders with a majority each
/// fit on the nodes without any node admitting more than `n` — three nodes and three
/// permits hold four leases on `{0,1} {1,2} {0,2} {0,1}`. With `q` votes each, `n + 1`
/// holders need `(n + 1)·q` places among the `nodes · n` there are; `q > nodes·n/(n+1)`
/// makes them not fit, so some node would have admitted `n + 1`, which none does. The
/// price is availability: three nodes and three permits need all three, five need
/// four; one node needs one, as a majority does.
pub(crate) fn for_mode(nodes: usize, mode: LockMode) -> usize {
    match mode {
        LockMode::Counted(permits) => {
            let permits = u64::from(permits.get());
            let nodes_wide = nodes as u64;
            let below = nodes_wide.saturating_mul(permits) / (permits + 1);
            usize::try_from(below + 1)
                .unwrap_or(nodes)
                .min(nodes.max(1))
        }
        _ => of(nodes),
    }
}

/// Whether an acquisition round is decided, with `won` grants, `answered` nodes that
/// granted or refused (contention), and `pending` nodes still to answer: won by a
/// majority of grants, or lost once a majority is out of reach *and* it is clear
/// whether enough nodes answered to call it contention rather than an unavailable
/// store.
pub(crate) fn acquisition_decided(
    quorum: usize,
    won: usize,
    answered: usize,
    pending: usize,
) -> bool {
    won >= quorum || (won + pending < quorum && (answered >= quorum || answered + pending < quorum))
}

/// Whether a yes/no round (release, extension) is decided, with `yes` and `no` answers
/// and `pending` nodes still to answer: either side has a majority, or neither can
/// reach one any more.
pub(crate) fn tally_decided(quorum: usize, yes: usize, no: usize, pending: usize) -> bool {
    yes >= quorum || no >= quorum || (yes + pending < quorum && no + pending < quorum)
}

/// Whether a count towards `needed` (a fence write-back's confirmations, a record's
/// copies) is decided, with `yes` answers so far and `pending` still to come: reached,
/// or out of reach.
pub(crate) fn count_decided(needed: usize, yes: usize, pending: usize) -> bool {
    yes >= needed || yes + pending < needed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `holders` leases with `votes` grants each can be placed on `nodes` nodes
    /// of `permits` places each: a greedy fill of the emptiest nodes is optimal here.
    fn fit(nodes: usize, permits: usize, holders: usize, votes: usize) -> bool {
        let mut used = vec![0; nodes];
        for _ in 0..holders {
            used.sort_unstable();
            for place in used.iter_mut().take(votes) {
                *place += 1;
            }
        }
        used.iter().all(|&u| u <= permits)
    }

    #[test]
    fn counted_leases_need_more_than_a_majority_so_n_plus_one_never_fit() {
        let counted = |n| LockMode::counted(n).unwrap();
        assert_eq!(for_mode(3, LockMode::Exclusive), 2);
        assert_eq!(for_mode(3, LockMode::Shared), 2);
        assert_eq!(for_mode(3, counted(1)), 2, "one permit is a majority");
        assert_eq!(for_mode(3, counted(3)), 3);
        assert_eq!(for_mode(5, counted(3)), 4);
        assert_eq!(for_mode(1, counted(7)), 1);
        assert_eq!(for_mode(5, counted(u32::MAX)), 5);
        for nodes in 1..=7 {
            for permits in 1..=6 {
                let votes = for_mode(nodes, counted(permits as u32));
                assert!(votes <= nodes);
                assert!(
                    !fit(nodes, permits, permits + 1, votes),
                    "{nodes} nodes, {permits} permits: {} holders of {votes} votes fit",
                    permits + 1
                );
                // And not more than needed: one vote fewer lets n + 1 fit.
                if votes > of(nodes) {
                    assert!(fit(nodes, permits, permits + 1, votes - 1));
                }
            }
        }
        assert!(
            fit(3, 3, 4, of(3)),
            "a majority lets three nodes of three permits hold four leases"
        );
    }
}
