//! Shared and counted holders (issue 38) in the history checker: no writer overlaps
//! anyone, readers overlap only readers, never more than `n` permit holders at once.
//! [`mode_violations`] is a pure function over recorded sections, tested on its own
//! below; `modes_hold_on_a_node` runs it over a real node's shared holders, driven at
//! the node level (the engine does not take these modes yet), and with `BROKEN=1` asks
//! the node for one permit more than the checker allows: that run must FAIL.

use std::collections::{HashMap, HashSet};
use std::fmt;

use super::*;
use tower_redlock::node::{Owner, Release, ResourceKeys};
use tower_redlock::{node::Node, LockMode, RedisNode};

/// How a section held its resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A writer: alone.
    Exclusive,
    /// A reader: beside readers only.
    Shared,
    /// One of at most `n` permit holders.
    Counted(usize),
}

/// One critical section: its resource, its mode, and when it began and ended on one
/// global sequence (as `History`'s sections; `None`: still open).
#[derive(Debug, Clone)]
pub struct Held {
    pub resource: String,
    pub mode: Mode,
    pub holder: String,
    pub start: u64,
    pub end: Option<u64>,
}

impl fmt::Display for Held {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let end = self.end.map_or("open".to_owned(), |end| end.to_string());
        write!(
            f,
            "`{}` {:?} by {} [seq {}..{end}]",
            self.resource, self.mode, self.holder, self.start
        )
    }
}

/// Every violation of the modes' invariants in `sections`. Two sections overlap when
/// one began before the other ended, so checking each section's start against the
/// sections live at that moment finds every overlapping pair.
pub fn mode_violations(sections: &[Held]) -> Vec<String> {
    let mut violations = Vec::new();
    let mut by_resource: HashMap<&str, Vec<&Held>> = HashMap::new();
    for held in sections {
        by_resource.entry(&held.resource).or_default().push(held);
    }
    for list in by_resource.values() {
        // (seq, is_start, index): the sequence numbers are unique, ends sort with them.
        let mut events: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * list.len());
        for (index, held) in list.iter().enumerate() {
            events.push((held.start, true, index));
            if let Some(end) = held.end {
                events.push((end, false, index));
            }
        }
        events.sort_unstable();
        let mut live: HashSet<usize> = HashSet::new();
        for (_, is_start, index) in events {
            if !is_start {
                live.remove(&index);
                continue;
            }
            let held = list[index];
            let clash = live.iter().map(|&other| list[other]).find(|other| {
                match (held.mode, other.mode) {
                    (Mode::Exclusive, _) | (_, Mode::Exclusive) => true,
                    (Mode::Shared, Mode::Shared) | (Mode::Counted(_), Mode::Counted(_)) => false,
                    // Readers overlap only readers.
                    _ => true,
                }
            });
            if let Some(other) = clash {
                violations.push(format!(
                    "{} overlaps {}:\n    {other}\n    {held}",
                    describe(held.mode),
                    describe(other.mode)
                ));
            }
            if let Mode::Counted(n) = held.mode {
                let holders = 1 + live
                    .iter()
                    .filter(|&&other| matches!(list[other].mode, Mode::Counted(_)))
                    .count();
                if holders > n {
                    violations.push(format!(
                        "{holders} permit holders of {n} at once, the last:\n    {held}"
                    ));
                }
            }
            live.insert(index);
        }
    }
    violations
}

fn describe(mode: Mode) -> &'static str {
    match mode {
        Mode::Exclusive => "a writer",
        Mode::Shared => "a reader",
        Mode::Counted(_) => "a permit holder",
    }
}

fn held(resource: &str, mode: Mode, start: u64, end: Option<u64>) -> Held {
    Held {
        resource: resource.to_owned(),
        mode,
        holder: format!("h{start}"),
        start,
        end,
    }
}

#[test]
fn checker_accepts_readers_together_and_writers_apart() {
    let history = [
        held("r", Mode::Shared, 1, Some(5)),
        held("r", Mode::Shared, 2, Some(4)),
        held("r", Mode::Exclusive, 6, Some(7)),
        held("r", Mode::Shared, 8, None),
        // Another resource overlaps freely.
        held("s", Mode::Exclusive, 3, Some(9)),
    ];
    assert_eq!(mode_violations(&history), Vec::<String>::new());
}

#[test]
fn checker_finds_a_writer_beside_a_reader() {
    let history = [
        held("r", Mode::Shared, 1, Some(5)),
        held("r", Mode::Exclusive, 3, Some(4)),
    ];
    let found = mode_violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("a writer overlaps a reader"),
        "{found:?}"
    );
}

#[test]
fn checker_finds_a_reader_beside_a_writer_and_two_writers() {
    let history = [
        held("r", Mode::Exclusive, 1, None),
        held("r", Mode::Shared, 2, Some(3)),
        held("r", Mode::Exclusive, 4, Some(5)),
    ];
    let found = mode_violations(&history);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].starts_with("a reader overlaps a writer"));
    assert!(found[1].starts_with("a writer overlaps a writer"));
}

#[test]
fn checker_finds_a_reader_beside_a_permit() {
    let history = [
        held("r", Mode::Counted(3), 1, Some(4)),
        held("r", Mode::Shared, 2, Some(3)),
    ];
    let found = mode_violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("a reader overlaps a permit holder"));
}

#[test]
fn checker_counts_permits() {
    let mut history = vec![
        held("p", Mode::Counted(2), 1, Some(10)),
        held("p", Mode::Counted(2), 2, Some(4)),
        // The second ended: two at once again.
        held("p", Mode::Counted(2), 5, Some(8)),
    ];
    assert_eq!(mode_violations(&history), Vec::<String>::new());
    // A third while two hold.
    history.push(held("p", Mode::Counted(2), 6, Some(7)));
    let found = mode_violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("3 permit holders of 2"), "{found:?}");
}

/// Readers, writers and permits on one real node, at the node level: 32 tasks, each
/// many attempts, every grant recorded as a section on one global sequence and checked
/// by [`mode_violations`]. With `BROKEN=1` the permit holders ask the node for one
/// permit more than the checker allows, which it must catch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modes_hold_on_a_node() {
    const TASKS: usize = 32;
    const ATTEMPTS: usize = 200;
    const PERMITS: usize = 3;
    let server = RedisServer::start();
    let node: Arc<dyn Node> = Arc::new(RedisNode::open(server.url()).unwrap());
    let asked = if broken() {
        eprintln!("BROKEN=1: the node grants {} permits", PERMITS + 1);
        PERMITS + 1
    } else {
        PERMITS
    };
    let owner = support::node_calls::owners().await;
    let clock = Arc::new(AtomicU64::new(0));
    let history = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            // Tasks 0–7 read and write `rw` (one writer in four), the rest take permits.
            let (resource, mode, node_mode) = match task {
                0 | 4 => ("rw", Mode::Exclusive, LockMode::Exclusive),
                1..=7 => ("rw", Mode::Shared, LockMode::Shared),
                _ => (
                    "permits",
                    Mode::Counted(PERMITS),
                    LockMode::counted(u32::try_from(asked).unwrap()).unwrap(),
                ),
            };
            let keys = support::node_calls::keys(format!("modes:{{{resource}}}"));
            let (node, owner) = (node.clone(), owner.for_node(task));
            let (clock, history) = (clock.clone(), history.clone());
            tokio::spawn(async move {
                for _ in 0..ATTEMPTS {
                    if !take(&node, &keys, &owner, node_mode).await {
                        tokio::task::yield_now().await;
                        continue;
                    }
                    let start = clock.fetch_add(1, Ordering::SeqCst);
                    for _ in 0..3 {
                        tokio::task::yield_now().await;
                    }
                    let end = clock.fetch_add(1, Ordering::SeqCst);
                    history.lock().unwrap().push(Held {
                        resource: resource.to_owned(),
                        mode,
                        holder: format!("task {task}"),
                        start,
                        end: Some(end),
                    });
                    let keys = std::slice::from_ref(&keys);
                    let hold = support::node_calls::hold(keys, &owner, node_mode);
                    let released = node.release(&hold, Release::Wake).await;
                    assert!(released.unwrap(), "task {task} released what it held");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let history = history.lock().unwrap().clone();
    assert!(!history.is_empty());
    eprintln!("modes_hold_on_a_node: {} sections checked", history.len());
    let found = mode_violations(&history);
    assert!(
        found.is_empty(),
        "{} violation(s) in {} sections (first 5):\n  - {}",
        found.len(),
        history.len(),
        found[..found.len().min(5)].join("\n  - ")
    );
}

/// One attempt in `mode`; whether it was granted.
async fn take(node: &Arc<dyn Node>, keys: &ResourceKeys, owner: &Owner, mode: LockMode) -> bool {
    let keys = std::slice::from_ref(keys);
    let vote = node.acquire(&support::node_calls::acquire(keys, owner, mode));
    support::node_calls::granted(&vote.await.unwrap())
}

// ---------------------------------------------------------------------------------------
// 13. Readers, writers and permits through the engine under faults
// ---------------------------------------------------------------------------------------

/// Readers and writers of one resource and permit holders of another, through the
/// engine (`Redlock::acquire_as`) of four app instances over three nodes, while the
/// nodes fail in turn: node 0 killed, then restarted empty; node 1 paused (SIGSTOP),
/// then resumed; node 2 partitioned (its proxy a blackhole), then healed; then each node
/// restored from a stale snapshot, one at a time, after a ttl down. At least 1,000
/// critical sections in each phase, every one checked by
/// [`mode_violations`] (a section counts only while its lease was held: none may be
/// lost, a minority failing). Counted leases need every node of three here (see
/// `quorum::for_mode`): while one is down they are unavailable, never over the limit.
/// With `BROKEN=1` the permit holders ask for one permit more than the checker allows:
/// that run must FAIL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s13_modes_under_faults() {
    const PERMITS: u32 = 3;
    const RW: [&str; 4] = ["rw:0", "rw:1", "rw:2", "rw:3"];
    const PERMITS_AT: [&str; 2] = ["permits:0", "permits:1"];
    let _serial = SERIAL.lock().await;
    let mut servers = RedisServer::start_many(3);
    // Node 2 behind a proxy, to be partitioned; nodes 0 and 1 direct, to be killed and
    // paused.
    let proxy = Proxy::start(servers[2].addr());
    let urls = vec![servers[0].url(), servers[1].url(), proxy.url()];
    let ttl = ms(2000);
    let options = LockOptions::default().ttl(ttl).node_timeout(ms(30));
    let lockers = lockers(4, &urls, &options);
    let asked = if broken() {
        eprintln!(
            "BROKEN=1: the permit holders ask for {} permits",
            PERMITS + 1
        );
        PERMITS + 1
    } else {
        PERMITS
    };
    let clock = Arc::new(AtomicU64::new(0));
    let sections = Arc::new(AtomicU64::new(0));
    let lost = Arc::new(AtomicU64::new(0));
    let history = Arc::new(Mutex::new(Vec::new()));
    let (stop, stopped) = watch::channel(false);
    // Four resources of one writer and three readers each, two of four permit holders
    // each: a node that stops answering adds its timeout to every release (a release
    // waits for every node), so one resource alone would crawl.
    let tasks: Vec<_> = (0..24)
        .map(|task| {
            let (resource, mode, lock_mode) = match task {
                0..=15 if task % 4 == 0 => (RW[task / 4], Mode::Exclusive, LockMode::Exclusive),
                0..=15 => (RW[task / 4], Mode::Shared, LockMode::Shared),
                _ => (
                    PERMITS_AT[task % 2],
                    Mode::Counted(PERMITS as usize),
                    LockMode::counted(asked).unwrap(),
                ),
            };
            let locker = lockers[task % lockers.len()].clone();
            let (clock, sections, lost) = (clock.clone(), sections.clone(), lost.clone());
            let (history, stopped) = (history.clone(), stopped.clone());
            tokio::spawn(async move {
                let mut cycle = 0_u64;
                while !*stopped.borrow() {
                    cycle += 1;
                    // A writer waits (and holds readers back) one time in four, and
                    // otherwise only tries: waiting all the time, two writers would
                    // leave the readers nothing (writer preference).
                    let taken = if lock_mode.is_exclusive() && !cycle.is_multiple_of(4) {
                        locker.try_acquire_as(resource, lock_mode).await
                    } else {
                        locker.acquire_as(resource, lock_mode, ms(500)).await
                    };
                    let lease = match taken {
                        Ok(lease) => lease,
                        Err(error) => {
                            if verbose() {
                                eprintln!("[s13] task {task}: {error}");
                            }
                            tokio::task::yield_now().await;
                            continue;
                        }
                    };
                    let start = clock.fetch_add(1, Ordering::SeqCst);
                    for _ in 0..3 {
                        tokio::task::yield_now().await;
                    }
                    let end = clock.fetch_add(1, Ordering::SeqCst);
                    if lease.is_held() {
                        history.lock().unwrap().push(Held {
                            resource: resource.to_owned(),
                            mode,
                            holder: format!("task {task}"),
                            start,
                            end: Some(end),
                        });
                    } else {
                        lost.fetch_add(1, Ordering::SeqCst);
                    }
                    lease.release().await;
                    sections.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    let phase = |name: &'static str| {
        let sections = sections.clone();
        async move {
            let target = sections.load(Ordering::SeqCst) + n(1000);
            support::eventually(name, bound(60), || {
                sections.load(Ordering::SeqCst) >= target
            })
            .await;
        }
    };
    phase("all nodes up").await;
    blocking(|| servers[0].kill());
    phase("node 0 killed").await;
    blocking(|| servers[0].restart());
    phase("node 0 restarted empty").await;
    blocking(|| servers[1].pause());
    phase("node 1 paused").await;
    blocking(|| servers[1].resume());
    phase("node 1 resumed").await;
    proxy.blackhole();
    phase("node 2 partitioned").await;
    proxy.heal();
    phase("node 2 healed").await;
    // Stale restores, as s10's: a snapshot of each node in turn while the load runs,
    // then each node killed and brought back from its snapshot after a ttl (the fault's
    // duration, not a synchronisation), one at a time.
    let mut snapshots = Vec::new();
    for server in &servers {
        snapshots.push(blocking(|| server.snapshot()));
        phase("after a snapshot").await;
    }
    for (k, snapshot) in snapshots.iter().enumerate() {
        blocking(|| servers[k].kill());
        tokio::time::sleep(ttl).await;
        blocking(|| servers[k].restart_from(snapshot));
        phase("a node restored from its stale snapshot").await;
    }
    stop.send_replace(true);
    for task in tasks {
        task.await.unwrap();
    }

    let history = history.lock().unwrap().clone();
    println!(
        "[faults] s13_modes_under_faults: {} sections checked ({} writers, {} readers, {} permits), {} leases lost",
        history.len(),
        history.iter().filter(|h| h.mode == Mode::Exclusive).count(),
        history.iter().filter(|h| h.mode == Mode::Shared).count(),
        history.iter().filter(|h| matches!(h.mode, Mode::Counted(_))).count(),
        lost.load(Ordering::SeqCst)
    );
    let found = mode_violations(&history);
    assert!(
        found.is_empty(),
        "{} violation(s) in {} sections (first 5):\n  - {}",
        found.len(),
        history.len(),
        found[..found.len().min(5)].join("\n  - ")
    );
    assert_eq!(
        lost.load(Ordering::SeqCst),
        0,
        "a minority failure must not cost a holder its lease"
    );
}
