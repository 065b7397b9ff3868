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

/// The number of votes that decides among `nodes` nodes: `nodes / 2 + 1`.
pub(crate) fn of(nodes: usize) -> usize {
    nodes / 2 + 1
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

    #[test]
    fn majorities() {
        assert_eq!((1..=6).map(of).collect::<Vec<_>>(), [1, 2, 2, 3, 3, 4]);
    }

    #[test]
    fn an_acquisition_waits_for_what_can_still_change_its_outcome() {
        // 3 nodes, quorum 2.
        assert!(acquisition_decided(2, 2, 2, 1), "won");
        assert!(!acquisition_decided(2, 1, 1, 2), "one grant, two to come");
        assert!(acquisition_decided(2, 0, 2, 1), "two refusals: contention");
        assert!(
            !acquisition_decided(2, 0, 1, 1),
            "one refusal, one failure, one to come"
        );
        assert!(
            acquisition_decided(2, 0, 1, 0),
            "one refusal, two failures: unavailable"
        );
    }

    #[test]
    fn a_tally_is_decided_by_a_majority_or_by_none_being_possible() {
        assert!(tally_decided(2, 2, 0, 1));
        assert!(tally_decided(2, 0, 2, 1));
        assert!(!tally_decided(2, 1, 1, 1));
        assert!(tally_decided(2, 1, 0, 0), "neither side can reach 2");
    }

    #[test]
    fn a_count_is_decided_once_reached_or_out_of_reach() {
        assert!(count_decided(2, 2, 1));
        assert!(!count_decided(2, 1, 1));
        assert!(count_decided(2, 0, 1));
    }
}
