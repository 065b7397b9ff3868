//! The PostgreSQL node (feature `postgres`) against the machine's PostgreSQL, a database
//! of its own per test (`support::postgres`), directly and through a private
//! `pgbouncer` in transaction pooling mode. No sleeps sequence anything; no timing is
//! asserted.
use crate::support;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sqlx::Connection;
use support::eventually_async;
use support::history::History;
use support::postgres::TestDatabase;
use tower_redlock::node::Node;
use tower_redlock::{node_from_url, LockError, LockOptions, PostgresNode, Redlock};

/// Bound on things that happen promptly; only reached when a test fails.
const PROMPTLY: Duration = Duration::from_secs(30);

fn options() -> LockOptions {
    LockOptions::default().node_timeout(Duration::from_secs(2))
}

#[cfg(feature = "test-util")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_node_keeps_the_contract() {
    use std::sync::Arc;
    use tower_redlock::node::conformance::{check, Contract};
    // Inline statements (the default) and prepared ones: the same contract.
    for prepared in [false, true] {
        let db = TestDatabase::create().await;
        let node = PostgresNode::new(db.pool(4).await).prepared_statements(prepared);
        check(
            &|| Arc::new(node.clone()) as Arc<dyn Node>,
            Contract::default(),
        )
        .await;
    }
}

/// Inline statements carry the keys as literals: a key that would end a literal or read
/// as a placeholder is the same row for inline and prepared statements (each excludes
/// the other on it), and a NUL, which a query string cannot carry, is refused with
/// nothing left behind.
#[tokio::test]
async fn keys_that_would_break_a_literal_are_one_row_either_way() {
    let db = TestDatabase::create().await;
    let pools = [db.pool(2).await, db.pool(2).await];
    let [inline, prepared] = [false, true].map(|prepared| {
        let node =
            PostgresNode::new(pools[usize::from(prepared)].clone()).prepared_statements(prepared);
        Redlock::new([node], options()).unwrap()
    });
    for key in [
        "it's",
        r"back\slash\",
        r"E'\'; --",
        "$1 $2",
        "ключ 🔑",
        "a'b'c''d",
    ] {
        for (first, second) in [(&inline, &prepared), (&prepared, &inline)] {
            let lease = first.try_acquire(key).await.expect(key);
            assert!(second.try_acquire(key).await.is_err(), "{key}: taken twice");
            lease.release().await;
            second.try_acquire(key).await.expect(key).release().await;
        }
    }
    for locker in [&inline, &prepared] {
        assert!(locker.try_acquire("nul\0key").await.is_err());
    }
    let leases: i64 = sqlx::query_scalar("SELECT count(*) FROM redlock_leases")
        .fetch_one(&db.pool(1).await)
        .await
        .unwrap();
    assert_eq!(leases, 0, "a lease row left behind");
}

/// Two lockers (two pools: two processes as far as the lock can tell) take turns on one
/// resource, each section a read-modify-write of a counter in the database; the
/// history checker finds no overlap, and no increment is lost.
async fn exclusion_under_contention(db: &TestDatabase, urls: [String; 2]) {
    let history = History::new("postgres_contention");
    let ledger = db.pool(2).await;
    sqlx::raw_sql("CREATE TABLE ledger (n int NOT NULL); INSERT INTO ledger VALUES (0)")
        .execute(&ledger)
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for (holder, url) in urls.into_iter().enumerate() {
        let locker = Redlock::from_nodes(vec![node_from_url(&url).unwrap()], options()).unwrap();
        let (history, ledger) = (history.clone(), ledger.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let lease = locker.acquire("contended", PROMPTLY).await.unwrap();
                let mut section = history.begin(
                    "contended",
                    lease.fencing_token().get(),
                    format!("{holder}"),
                );
                let n: i32 = sqlx::query_scalar("SELECT n FROM ledger")
                    .fetch_one(&ledger)
                    .await
                    .unwrap();
                sqlx::query("UPDATE ledger SET n = $1")
                    .bind(n + 1)
                    .execute(&ledger)
                    .await
                    .unwrap();
                section.write();
                section.end(!lease.is_held());
                lease.release().await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let summary = history.check();
    assert_eq!(history.rejected(), 0, "{summary}");
    assert_eq!(history.sections().len(), 20);
    let n: i32 = sqlx::query_scalar("SELECT n FROM ledger")
        .fetch_one(&ledger)
        .await
        .unwrap();
    assert_eq!(n, 20, "an increment was lost: two holders at once");
}

/// A waiter whose retry policy waits an hour gets the lock when the holder releases:
/// only the release's NOTIFY can have woken it. With `cut`, the listener's connection
/// is terminated while it waits: it must listen again on a new one.
async fn a_waiter_is_woken_by_notify(urls: [String; 2], cut: Option<&TestDatabase>) {
    let holder = Redlock::from_nodes(vec![node_from_url(&urls[0]).unwrap()], options()).unwrap();
    let waiter = Redlock::from_nodes(
        vec![node_from_url(&urls[1]).unwrap()],
        options().retry_policy(|_: u32, _: Option<Duration>| Duration::from_secs(3600)),
    )
    .unwrap();
    let lease = holder.try_acquire("wake").await.unwrap();
    let waiting = tokio::spawn({
        let waiter = waiter.clone();
        async move { waiter.acquire("wake", Duration::from_secs(3600)).await }
    });
    // Subscribed (the LISTEN is in place before a subscription counts) and refused
    // once more after it: from now on only a notification brings it back.
    eventually_async("the waiter listens", PROMPTLY, || {
        let waiter = waiter.clone();
        async move {
            let metrics = waiter.metrics();
            metrics.waits >= 1 && metrics.contended >= 2
        }
    })
    .await;
    if let Some(db) = cut {
        cut_the_listener(db).await;
    }
    lease.release().await;
    let next = tokio::time::timeout(PROMPTLY, waiting)
        .await
        .expect("woken by the NOTIFY, not by the hour-long retry")
        .unwrap()
        .unwrap();
    assert!(next.is_held());
    next.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_exclusion_and_wake_up() {
    let db = TestDatabase::create().await;
    // One locker with inline statements, one with prepared ones: the same rows.
    let prepared = format!("{}?statements=prepared", db.url());
    let urls = || [db.url().to_owned(), prepared.clone()];
    exclusion_under_contention(&db, urls()).await;
    a_waiter_is_woken_by_notify(urls(), None).await;
    a_waiter_is_woken_by_notify(urls(), Some(&db)).await;
}

/// Terminates the `LISTEN` connections to `db`, and returns once new ones listen.
async fn cut_the_listener(db: &TestDatabase) {
    let mut admin = db.connect().await;
    let listening = "SELECT pid FROM pg_stat_activity
        WHERE datname = current_database() AND query ILIKE 'LISTEN%'";
    let cut: Vec<i32> = sqlx::query_scalar(listening)
        .fetch_all(&mut admin)
        .await
        .unwrap();
    assert!(!cut.is_empty(), "no LISTEN connection to cut");
    for pid in &cut {
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .execute(&mut admin)
            .await
            .unwrap();
    }
    eventually_async("the listener listens again", PROMPTLY, || {
        let (cut, admin_url) = (cut.clone(), db.url().to_owned());
        async move {
            let mut admin = sqlx::PgConnection::connect(&admin_url).await.unwrap();
            let now: Vec<i32> = sqlx::query_scalar(listening)
                .fetch_all(&mut admin)
                .await
                .unwrap();
            now.iter().any(|pid| !cut.contains(pid))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_pgbouncer_in_transaction_mode() {
    let db = TestDatabase::create().await;
    let bouncer = PgBouncer::start();
    let database = db.url().rsplit('/').next().unwrap();
    // The lock's statements through the pooler; LISTEN straight to the server.
    let direct: String = db
        .url()
        .bytes()
        .map(|b| match b {
            b':' | b'/' | b'@' => format!("%{b:02X}"),
            _ => char::from(b).to_string(),
        })
        .collect();
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/{database}?listen={direct}",
        bouncer.port
    );
    let urls = || [url.clone(), url.clone()];
    exclusion_under_contention(&db, urls()).await;
    a_waiter_is_woken_by_notify(urls(), None).await;
}

/// The fence counters come back behind (a `pg_dump` restored: the table truncated and
/// an older copy put back): tokens still increase, thanks to the clock floor; the
/// unsafe rule that floors only a missing counter goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_across_a_restore_of_the_counters() {
    let db = TestDatabase::create().await;
    let pool = db.pool(2).await;
    let restore = |options: LockOptions| {
        let pool = pool.clone();
        async move {
            let locker = Redlock::new([PostgresNode::new(pool.clone())], options).unwrap();
            let mut tokens = Vec::new();
            take(&locker, &mut tokens).await;
            sqlx::raw_sql("DROP TABLE IF EXISTS dump; CREATE TABLE dump AS SELECT * FROM redlock_fence_counters")
                .execute(&pool)
                .await
                .unwrap();
            for _ in 0..50 {
                take(&locker, &mut tokens).await;
            }
            sqlx::raw_sql("TRUNCATE redlock_fence_counters; INSERT INTO redlock_fence_counters SELECT * FROM dump")
                .execute(&pool)
                .await
                .unwrap();
            take(&locker, &mut tokens).await;
            sqlx::raw_sql("TRUNCATE redlock_fence_counters")
                .execute(&pool)
                .await
                .unwrap();
            take(&locker, &mut tokens).await;
            tokens
        }
    };
    let tokens = restore(options()).await;
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
    let unsafe_rule = restore(options().unsafe_fence_seed_only_when_missing()).await;
    assert!(
        unsafe_rule.windows(2).any(|w| w[0] >= w[1]),
        "the restore went unnoticed: the test cannot fail: {unsafe_rule:?}"
    );
}

/// The node's schema, as its documentation gives it for a migration.
const SCHEMA: &str = include_str!("../../src/node/postgres/tables.sql");

/// The part of [`SCHEMA`] an earlier version created: its tables, without the functions.
fn earlier_tables() -> &'static str {
    SCHEMA.split("CREATE OR REPLACE FUNCTION").next().unwrap()
}

/// A database whose tables an earlier version created, without the functions the lock's
/// calls are now: the node creates what is missing on first use, and the leases and
/// counters already there stay in force (the counter goes on from where it was).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_without_the_functions_get_them_on_first_use() {
    let db = TestDatabase::create().await;
    let pool = db.pool(2).await;
    let tables = earlier_tables();
    sqlx::raw_sql(tables).execute(&pool).await.unwrap();
    let counter = i64::MAX / 4;
    sqlx::raw_sql(&format!(
        "INSERT INTO redlock_leases VALUES ('redlock:{{held}}', 'someone', now() + interval '1 hour'); \
         INSERT INTO redlock_fence_counters \
         VALUES ('redlock:{{held}}:fence', {counter}, now() + interval '1 hour')"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let locker = Redlock::new([PostgresNode::new(pool.clone())], options()).unwrap();
    let refused = locker
        .try_acquire("held")
        .await
        .map(drop)
        .expect_err("held");
    assert!(matches!(refused, LockError::Held { .. }), "{refused:?}");
    sqlx::raw_sql("DELETE FROM redlock_leases")
        .execute(&pool)
        .await
        .unwrap();
    let lease = locker.try_acquire("held").await.unwrap();
    assert!(lease.fencing_token().get() > counter as u64, "{lease:?}");
    lease.release().await;
}

/// Processes that start together on a fresh database all create the schema on their
/// first call: each creation waits for the one before (two at once would fail on the
/// catalogue's unique rows, or on a function replaced concurrently).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_uses_at_once_all_find_the_schema() {
    let db = TestDatabase::create().await;
    let mut lockers = Vec::new();
    for _ in 0..8 {
        let node = PostgresNode::new(db.pool(1).await);
        lockers.push(Redlock::new([node], options()).unwrap());
    }
    let first = lockers
        .iter()
        .enumerate()
        .map(|(i, locker)| locker.try_acquire(format!("first-{i}")));
    for (i, taken) in futures_util::future::join_all(first)
        .await
        .into_iter()
        .enumerate()
    {
        let lease = taken.unwrap_or_else(|e| panic!("locker {i}: {e}"));
        lease.release().await;
    }
}

/// A role that may not create (a database's tables created by an earlier version, the
/// application's role granted their rows only): its calls fail with an error that names
/// the migration, and once an owner ran it the same node works, checking nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_may_not_create_is_told_to_run_the_migration() {
    let db = TestDatabase::create().await;
    let owner = db.pool(1).await;
    let tables = earlier_tables();
    let role = format!("redlock_app_{:08x}", rand::random::<u32>());
    sqlx::raw_sql(&format!(
        "{tables}; CREATE ROLE {role} NOLOGIN; \
         GRANT SELECT, INSERT, UPDATE, DELETE \
         ON redlock_leases, redlock_fence_counters, redlock_node_records TO {role}"
    ))
    .execute(&owner)
    .await
    .unwrap();
    // Signed in as the test's user, acting as the role for every statement.
    let as_role = db
        .url()
        .parse::<sqlx::postgres::PgConnectOptions>()
        .unwrap()
        .options([("role", role.as_str())]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(as_role)
        .await
        .unwrap();
    let locker = Redlock::new([PostgresNode::new(pool.clone())], options()).unwrap();
    let refused = locker.try_acquire("r").await.map(drop);
    sqlx::raw_sql(SCHEMA).execute(&owner).await.unwrap();
    let after = match locker.try_acquire("r").await {
        Ok(lease) => Ok(lease.release().await),
        Err(error) => Err(error),
    };
    // The role is the server's, not the database's: gone before anything is asserted.
    pool.close().await;
    sqlx::raw_sql(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .execute(&owner)
        .await
        .unwrap();
    let error = refused
        .expect_err("acquired without the functions")
        .to_string();
    assert!(error.contains("run the migration"), "{error}");
    let released = after.expect("the same node, once the migration ran");
    assert_eq!(released, tower_redlock::ReleaseOutcome::Released);
}

/// A database that refuses writes (`default_transaction_read_only`, as a standby's
/// `transaction_read_only` also reads) is refused at connect, as a Redis replica is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_database_is_refused_at_connect() {
    let db = TestDatabase::create().await;
    Redlock::connect([db.url()], options()).await.unwrap();
    let name = db.url().rsplit('/').next().unwrap();
    sqlx::raw_sql(&format!(
        "ALTER DATABASE \"{name}\" SET default_transaction_read_only = on"
    ))
    .execute(&db.pool(1).await)
    .await
    .unwrap();
    let error = Redlock::connect([db.url()], options())
        .await
        .map(drop)
        .expect_err("a read-only database was accepted")
        .to_string();
    assert!(error.contains("(role read-only)"), "{error}");
}

async fn take(locker: &Redlock, tokens: &mut Vec<u64>) {
    let lease = locker.try_acquire("restored").await.unwrap();
    tokens.push(lease.fencing_token().get());
    lease.release().await;
}

/// A private pgbouncer on a free port, `pool_mode = transaction`, trust auth, in front
/// of the server at `$TOWER_REDLOCK_PG`; killed when dropped.
struct PgBouncer {
    port: u16,
    child: Child,
    dir: PathBuf,
}

impl PgBouncer {
    fn start() -> PgBouncer {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("tower-redlock-test-pgbouncer-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("pgbouncer.ini");
        let server: sqlx::postgres::PgConnectOptions =
            support::postgres::server_url().parse().unwrap();
        std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").unwrap();
        std::fs::write(
            &config,
            format!(
                "[databases]\n* = host={} port={}\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
                 unix_socket_dir =\nauth_type = trust\nauth_file = {}\n\
                 pool_mode = transaction\ndefault_pool_size = 4\n\
                 ignore_startup_parameters = extra_float_digits,options\n",
                server.get_host(),
                server.get_port(),
                dir.join("users.txt").display()
            ),
        )
        .unwrap();
        let mut command = Command::new(
            std::env::var("PGBOUNCER").unwrap_or_else(|_| "/usr/sbin/pgbouncer".to_owned()),
        );
        // pgbouncer refuses to run as root; `-u` makes it drop to that user.
        if is_root() {
            command.args(["-u", "postgres"]);
        }
        let child = command
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn pgbouncer");
        let bouncer = PgBouncer { port, child, dir };
        let started = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < PROMPTLY,
                "pgbouncer did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        bouncer
    }
}

pub(super) fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

pub(super) fn is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Outcome records beyond the conformance suite: an earlier holder's marker orphaned
/// (once), its token remembered for the claim that runs the work again, a completed
/// record superseding older ones. Run on the memory node too, the reference, so the
/// expectations are the contract's and not this node's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_orphan_remember_and_supersede_as_the_memory_node_does() {
    let db = TestDatabase::create().await;
    record_story(&tower_redlock::MemoryNode::new()).await;
    record_story(&PostgresNode::new(db.pool(2).await)).await;
}

async fn record_story(node: &dyn Node) {
    use bytes::Bytes;
    use support::node_calls::{acquire, keys, owners};
    use tower_redlock::node::{ClaimReply, ClaimRequest, Hold, Record, Release, StoreReply};
    use tower_redlock::node::{StoreRequest, Vote};
    use tower_redlock::{FencingToken, LockMode};
    let store = node.records().expect("records");
    let keys = [keys("redlock:{story}".to_owned())];
    let owner = owners().await;
    let (first, second) = (owner.for_node(1), owner.for_node(2));
    let take = async |owner| match node
        .acquire(&acquire(&keys, owner, LockMode::Exclusive))
        .await
    {
        Ok(Vote::Granted { fences }) => fences[0],
        other => panic!("{other:?}"),
    };
    let claim = |owner, token, orphan_ttl| ClaimRequest {
        keys: &keys[0],
        owner,
        token,
        fingerprint: b"fp",
        pending_ttl: Duration::from_secs(60),
        orphan_ttl,
        remember_interrupted: Some(Duration::from_secs(60)),
    };
    let t1 = take(&first).await;
    assert_eq!(
        store.claim_record(&claim(&first, t1, None)).await.unwrap(),
        ClaimReply::Claimed
    );
    let hold = Hold {
        keys: &keys,
        owner: &first,
        mode: LockMode::Exclusive,
    };
    assert!(node.release(&hold, Release::Wake).await.unwrap());
    let t2 = take(&second).await;
    // The first holder's marker: orphaned, its life cut to 1 ms, its token remembered.
    let orphaned = store
        .claim_record(&claim(&second, t2, Some(Duration::from_millis(1))))
        .await;
    assert!(
        matches!(orphaned, Ok(ClaimReply::Orphaned { .. })),
        "{orphaned:?}"
    );
    eventually_async("the orphaned marker expires", PROMPTLY, || async {
        let again = store.claim_record(&claim(&second, t2, None)).await.unwrap();
        match again {
            ClaimReply::Orphaned { .. } => false,
            ClaimReply::ClaimedAfter { interrupted } => {
                assert_eq!(interrupted, t1);
                true
            }
            other => panic!("after the orphan: {other:?}"),
        }
    })
    .await;
    let record = |token| {
        Record::new(
            FencingToken::new(token),
            Bytes::from_static(b"fp"),
            Bytes::from_static(b"ok"),
        )
    };
    let keys = &keys;
    let put = |owner, record| async move {
        let request = StoreRequest {
            keys: &keys[0],
            owner,
            record: &record,
            retention: Duration::from_secs(60),
        };
        store.store_record(&request).await.unwrap()
    };
    assert_eq!(put(&first, record(t2)).await, StoreReply::NotOwner);
    assert_eq!(put(&second, record(t2)).await, StoreReply::Stored);
    assert_eq!(
        put(&second, record(t2)).await,
        StoreReply::Stored,
        "re-sent"
    );
    assert_eq!(put(&second, record(t1)).await, StoreReply::Superseded);
    assert_eq!(store.read_record(&keys[0]).await.unwrap(), Some(record(t2)));
    // Completed whoever asks; a completed record is not a marker to discard.
    let done = store.claim_record(&claim(&first, t1, None)).await.unwrap();
    assert_eq!(done, ClaimReply::Completed(record(t2)));
    assert!(!store.discard_record(&keys[0], t2).await.unwrap());
}
