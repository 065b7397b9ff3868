//! Scenarios 15 and 16: the PostgreSQL node (feature `postgres`) restarted, crashed and
//! cut off mid-section, and Kleppmann's paused holder refused by the fence in the
//! database. s15 runs on a private cluster (`support::postgres::PrivateCluster`): the
//! machine's server on 5432 is shared and never restarted.

use super::*;

use sqlx::Connection;
use support::postgres::{PrivateCluster, Shutdown, TestDatabase};
use tower_redlock::fence::{self, FenceError};
use tower_redlock::node_from_url;

fn pg_lockers(count: usize, url: &str, options: &LockOptions) -> Vec<Redlock> {
    (0..count)
        .map(|_| {
            Redlock::from_nodes(vec![node_from_url(url).expect("node")], options.clone())
                .expect("locker")
        })
        .collect()
}

/// `try_acquire` until the node answers for itself (a restarted server, connections to
/// re-open): `Ok` or a contention, never a "no answer".
async fn answered_try(locker: &Redlock, resource: &str) -> Result<Lease, LockError> {
    let deadline = Instant::now() + bound(20);
    loop {
        match locker.try_acquire(resource).await {
            Err(LockError::Unavailable { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(ms(20)).await;
            }
            other => return other,
        }
    }
}

/// Two lockers (two application instances) contend over one PostgreSQL node while the
/// server is stopped cleanly and restarted, crashed (`-m immediate`) and restarted, and
/// every session is terminated (`pg_terminate_backend`). Across each fault a lease taken
/// before it (ttl 30 s, no watchdog) must still hold the resource after it: the other
/// locker is refused. The history checker finds no two holders at once and no token
/// that goes back.
///
/// `BROKEN=1` makes the leases table `UNLOGGED` (no WAL: crash recovery empties it):
/// after the crash the other locker gets the lease that is still held, and the scenario
/// fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_postgres_restarted_crashed_and_cut_mid_section() {
    let _serial = SERIAL.lock().await;
    let cluster = blocking(PrivateCluster::start);
    let url = cluster.url();
    let setup = tower_redlock::PostgresNode::from_url(&url).expect("node");
    setup.create_tables().await.expect("tables");
    if broken() {
        eprintln!("BROKEN=1: the leases table is UNLOGGED (lost in a crash)");
        let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
        sqlx::query("ALTER TABLE redlock_leases SET UNLOGGED")
            .execute(&mut conn)
            .await
            .expect("SET UNLOGGED");
    }
    let ttl = ms(3000);
    let options = LockOptions::default().ttl(ttl).node_timeout(ms(1000));
    let contenders = pg_lockers(2, &url, &options);
    let holder = pg_lockers(1, &url, &options.clone().ttl(ms(30_000)).watchdog(false))
        .pop()
        .expect("holder");
    let history = History::new("s15_postgres_restarted_crashed_and_cut_mid_section");
    let load = Load::new(&HOT8[..4], ttl);
    let workers = Workers::spawn(&load, &contenders, 2, &history);
    progress(&history, n(30), bound(30), "before the faults").await;

    // A restart, or (`None`) every session terminated.
    let faults = [
        ("stop -m fast, start", Some(Shutdown::Fast)),
        (
            "stop -m immediate (crash), start",
            Some(Shutdown::Immediate),
        ),
        ("pg_terminate_backend of every session", None),
    ];
    let mut survived = 0;
    for (i, (fault, restart)) in faults.into_iter().enumerate() {
        let resource = format!("held-across:{i}");
        let lease = acquire_patiently(&holder, &resource, bound(20)).await;
        let mut section = history.begin(resource.as_str(), lease.fencing_token().get(), "holder");
        match restart {
            Some(how) => blocking(|| cluster.restart(how)),
            None => println!(
                "[faults]   sessions terminated: {}",
                cluster.terminate_sessions().await
            ),
        }
        match answered_try(&contenders[0], &resource).await {
            Err(e) if e.is_contention() => survived += 1,
            Ok(other) => {
                // Both write: the checker reports the overlap (and the test fails).
                let mut second =
                    history.begin(resource.as_str(), other.fencing_token().get(), "contender");
                second.write();
                second.end(false);
                history.fail(format!(
                    "`{resource}` granted again after `{fault}` while its holder held it"
                ));
                other.release().await;
            }
            Err(e) => panic!("after `{fault}`: {e}"),
        }
        section.write();
        section.end(lease.lost_cause().is_some());
        lease.release().await;
        progress(&history, n(30), bound(30), fault).await;
    }
    workers.stop().await;
    print_samples(&load);
    let mut all = contenders;
    all.push(holder);
    let summary = report(finish(&history, &all).note("held_across_faults", survived));
    assert_eq!(survived, 3, "{summary}");
}

/// Kleppmann's scenario on a PostgreSQL node, the data in the same database: A takes
/// the lease (no watchdog), opens its transaction and writes, then pauses until its
/// lease is reported lost; B takes the resource over, advances the fence and commits its
/// write; A resumes and advances the fence in its transaction: refused (`Stale`, B's
/// token), rolled back. A's late release does not free B's lease; C is refused while B
/// holds. Afterwards each resource has B's write only.
///
/// `BROKEN=1`: A commits without the fence; A's stale write lands and the scenario fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s16_postgres_paused_holder_is_fenced() {
    let _serial = SERIAL.lock().await;
    let db = TestDatabase::create().await;
    let data = db.pool(4).await;
    let mut conn = db.connect().await;
    fence::postgres::FenceTable::default()
        .create(&mut conn)
        .await
        .expect("fence table");
    sqlx::query("CREATE TABLE payments (resource text NOT NULL, written_by text NOT NULL)")
        .execute(&mut conn)
        .await
        .expect("payments");
    let ttl = ms(600);
    let options = LockOptions::default().ttl(ttl).node_timeout(ms(200));
    let a_locker = pg_lockers(1, db.url(), &options.clone().watchdog(false)).remove(0);
    let mut others = pg_lockers(2, db.url(), &options);
    let (c_locker, b_locker) = (others.pop().expect("C"), others.pop().expect("B"));
    let history = History::new("s16_postgres_paused_holder_is_fenced");
    let rounds = n(6);
    let (mut refused, mut release_not_held, mut c_refused) = (0, 0, 0);
    for round in 0..rounds {
        let resource = format!("payment:{round}");
        let a = acquire_patiently(&a_locker, &resource, bound(10)).await;
        let mut a_section = history.begin(resource.as_str(), a.fencing_token().get(), "A");
        let mut a_tx = data.begin().await.expect("A's transaction");
        let insert = "INSERT INTO payments VALUES ($1, $2)";
        sqlx::query(insert)
            .bind(&resource)
            .bind("A")
            .execute(&mut *a_tx)
            .await
            .expect("A's write");
        // The pause: A's task waits for its own lease to be gone (the event).
        tokio::time::timeout(bound(10), a.lost())
            .await
            .expect("A's lease reported lost");

        let b = acquire_patiently(&b_locker, &resource, bound(10)).await;
        assert!(
            b.fencing_token() > a.fencing_token(),
            "B's token must be higher"
        );
        let mut b_section = history.begin(resource.as_str(), b.fencing_token().get(), "B");
        let mut b_tx = data.begin().await.expect("B's transaction");
        fence::postgres::advance(&mut b_tx, &b)
            .await
            .expect("B's fence");
        sqlx::query(insert)
            .bind(&resource)
            .bind("B")
            .execute(&mut *b_tx)
            .await
            .expect("B's write");
        b_tx.commit().await.expect("B's commit");
        b_section.write();

        // A resumes.
        if broken() {
            a_tx.commit()
                .await
                .expect("A's commit (BROKEN=1: no fence)");
        } else {
            match fence::postgres::advance(&mut a_tx, &a).await {
                Err(FenceError::Stale { current, .. }) if current == b.fencing_token() => {
                    refused += 1;
                    a_tx.rollback().await.expect("A's rollback");
                }
                other => panic!("A's stale transaction must be refused: {other:?}"),
            }
        }
        a_section.write();
        a_section.end(true);
        if matches!(a.release().await, ReleaseOutcome::NotHeld) {
            release_not_held += 1;
        }
        match answered(|| c_locker.try_acquire(resource.as_str())).await {
            Err(e) if e.is_contention() => c_refused += 1,
            Ok(c) => {
                history.fail(format!("C got `{resource}` while B held it"));
                c.release().await;
            }
            Err(e) => panic!("C on `{resource}`: {e}"),
        }
        b_section.end(b.lost_cause().is_some());
        b.release().await;
    }
    let writers: Vec<(String, String)> =
        sqlx::query_as("SELECT resource, written_by FROM payments ORDER BY resource, written_by")
            .fetch_all(&mut conn)
            .await
            .expect("payments");
    let summary = report(
        finish(&history, &[a_locker, b_locker, c_locker])
            .note("a_refused_by_fence", refused)
            .note("a_release_not_held", release_not_held)
            .note("c_refused", c_refused),
    );
    let expected: Vec<(String, String)> = (0..rounds)
        .map(|round| (format!("payment:{round}"), "B".to_owned()))
        .collect();
    assert_eq!(writers, expected, "only B's writes may land: {summary}");
    assert_eq!(release_not_held, rounds);
    assert_eq!(c_refused, rounds);
}
