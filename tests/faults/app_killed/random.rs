//! Scenario 17, random kill points: the application process SIGKILLed at moments no
//! request announced, while [`CLIENTS`] keep-alive clients pay keys one after another
//! and retry each key (same key, same body) until it is answered.
//!
//! The moment of each kill is an event: a seeded RNG picks N, and the process is killed
//! as soon as the clients have seen N more payments answered. The other clients' requests
//! are then wherever they happen to be: before the claim, between the claim and the
//! handler's write, between the write and the commit, after the commit before the
//! response. The seed is printed; `S17_SEED=<seed>` repeats the schedule of kills
//! (N for each), not the timing, which the scheduler decides.
//!
//! Both claim modes run ([`ClaimMode`]). Asserted: exactly one payment row per key, and
//! every key's final answer names that row (`pay_<id>`). A retry is refused while the
//! dead process's lease lives (409 `request-in-progress`, or 503), then runs cleanly.
//! With `handlers_take_tx` it is never answered 409 `outcome-unknown` (asserted). With
//! `PgRecords::new` it can be, and is in most runs (1 to 4 keys of 480): a kill between
//! the claim's commit and `Tx`'s first statement leaves a marker not yet flagged
//! transactional, with no payment (seen by reading the row on the first such answer:
//! `data` NULL, `transactional` false, no `payments` row), so the key answers
//! `outcome-unknown` for the lock's ttl and then pays once; counted, not failed
//! ([`ClaimMode::unflagged_marker_possible`]).
//!
//! Seen failing with `BROKEN=1` (the payment committed on the pool, apart from its
//! record): in every run of both modes (12 of 12 with these counts), 2 to 8 keys had two
//! payment rows, paid by the killed attempt and again by its retry, e.g.
//! `c1-k1: 2 payments, answered "pay_90"`, once `c7-k11: 3 payments` (killed twice).

use super::*;

use std::collections::HashMap;

use crate::http_client::Reply;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Keep-alive clients paying at once: as many requests in flight at each kill.
const CLIENTS: usize = 8;

/// Keys each client pays, one after another (times `SOAK`).
const KEYS_PER_CLIENT: u64 = 60;

/// Kills of the application process (times `SOAK`).
const KILLS: u64 = 10;

/// The most answers between two kills: all the kills fit in the run's answers with
/// payments left for the last process, so every kill finds payments in flight.
const MOST_ANSWERS_BETWEEN_KILLS: u64 = 40;

/// Attempts at one key before its client gives up: the scenario fails rather than hangs.
const ATTEMPTS_PER_KEY: u32 = 400;

/// The process the clients are to use: how many were killed before it, and its address.
type Serving = (u64, SocketAddr);

/// What the clients saw besides their answers.
#[derive(Default)]
struct Tally {
    replayed: AtomicU64,
    in_progress: AtomicU64,
    unavailable: AtomicU64,
    outcome_unknown: AtomicU64,
    /// Keys answered `outcome-unknown` at least once.
    unknown_keys: AtomicU64,
    broken: AtomicU64,
}

impl Tally {
    fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s17_app_process_killed_at_random_points() {
    killed_at_random_points(ClaimMode::BeforeHandler).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s17_app_process_killed_at_random_points_handlers_take_tx() {
    killed_at_random_points(ClaimMode::InHandlersTx).await;
}

async fn killed_at_random_points(mode: ClaimMode) {
    let _serial = SERIAL.lock().await;
    let seed = match std::env::var("S17_SEED") {
        Ok(seed) => seed.parse().expect("S17_SEED: a u64"),
        Err(_) => rand::random(),
    };
    // Printed first, so that a failing run names its seed.
    println!("[faults] s17 random kills ({}): seed={seed}", mode.name());
    let mut rng = StdRng::seed_from_u64(seed);
    let (db, pool) = payments_database().await;
    let started = Instant::now();
    let mut app = App::start(db.url(), mode).await;
    let (serving, _) = watch::channel::<Serving>((0, app.addr));
    let (answered, mut answers_seen) = watch::channel(0u64);
    let answered = Arc::new(answered);
    let tally = Arc::new(Tally::default());
    let mut clients = JoinSet::new();
    for client in 0..CLIENTS {
        clients.spawn(pay_keys(
            client,
            serving.subscribe(),
            answered.clone(),
            tally.clone(),
        ));
    }
    let mut answers = Vec::new();
    for kill in 1..=n(KILLS) {
        let target = *answers_seen.borrow() + rng.random_range(1..=MOST_ANSWERS_BETWEEN_KILLS);
        tokio::time::timeout(bound(30), async {
            loop {
                tokio::select! {
                    reached = answers_seen.wait_for(|seen| *seen >= target) => {
                        reached.map(drop).expect("the answers' counter");
                        break;
                    }
                    // A client that panicked fails the scenario now, not at the bound.
                    Some(done) = clients.join_next() => answers.extend(finished(done)),
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{target} payments answered before kill {kill}"));
        app.kill().await;
        app = App::start(db.url(), mode).await;
        serving.send_replace((kill, app.addr));
    }
    while let Some(done) = clients.join_next().await {
        answers.extend(finished(done));
    }
    app.kill().await;
    let payments: Vec<(String, i64, i64)> =
        sqlx::query_as("SELECT key, count(*), min(id) FROM payments GROUP BY key")
            .fetch_all(&pool)
            .await
            .expect("payments");
    let payments: HashMap<String, (i64, i64)> = payments
        .into_iter()
        .map(|(key, count, id)| (key, (count, id)))
        .collect();
    let wrong: Vec<String> = answers
        .iter()
        .filter_map(|(key, reply)| {
            let (count, id) = payments.get(key).copied().unwrap_or_default();
            let answer = reply.text();
            (count != 1 || answer != format!("pay_{id}"))
                .then(|| format!("{key}: {count} payments, answered {answer:?}"))
        })
        .collect();
    println!(
        "[faults] s17_app_process_killed_at_random_points ({}): seed={seed} kills={} payments={} replayed={} retries: in_progress={} unavailable={} outcome_unknown={} (keys {}) broken_connections={} wrong={} elapsed={:.2}s",
        mode.name(),
        n(KILLS),
        answers.len(),
        Tally::get(&tally.replayed),
        Tally::get(&tally.in_progress),
        Tally::get(&tally.unavailable),
        Tally::get(&tally.outcome_unknown),
        Tally::get(&tally.unknown_keys),
        Tally::get(&tally.broken),
        wrong.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(answers.len() as u64, CLIENTS as u64 * n(KEYS_PER_CLIENT));
    assert!(wrong.is_empty(), "seed {seed}: {wrong:#?}");
    assert_eq!(payments.len(), answers.len(), "payments of keys never sent");
    if !mode.unflagged_marker_possible() {
        assert_eq!(
            Tally::get(&tally.unknown_keys),
            0,
            "seed {seed}: a Tx payment's retry answered outcome-unknown"
        );
    }
}

fn finished(done: Result<Vec<(String, Reply)>, tokio::task::JoinError>) -> Vec<(String, Reply)> {
    done.unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()))
}

/// One client: its keys paid one after another on a keep-alive connection, each retried
/// until answered 201, on the next process once its connection broke. Returns each
/// key's final answer.
async fn pay_keys(
    client: usize,
    mut serving: watch::Receiver<Serving>,
    answered: Arc<watch::Sender<u64>>,
    tally: Arc<Tally>,
) -> Vec<(String, Reply)> {
    // With the number of kills before the process it was opened to: a connection that
    // breaks waits for that process's successor, which may already be serving.
    let mut conn: Option<(u64, Conn)> = None;
    let mut answers = Vec::new();
    for k in 0..n(KEYS_PER_CLIENT) {
        let key = format!("c{client}-k{k}");
        let request = payment(&key);
        let mut attempts = 0;
        let mut unknown = false;
        let reply = loop {
            attempts += 1;
            assert!(
                attempts <= ATTEMPTS_PER_KEY,
                "{key}: not paid in {ATTEMPTS_PER_KEY} attempts"
            );
            let (killed, reply) = match &mut conn {
                Some((killed, open)) => (*killed, open.try_send(&request).await),
                None => {
                    let (killed, addr) = *serving.borrow();
                    match Conn::try_open(addr).await {
                        Some(open) => (
                            killed,
                            conn.insert((killed, open)).1.try_send(&request).await,
                        ),
                        None => (killed, None),
                    }
                }
            };
            let Some(reply) = reply else {
                // The process is gone: its successor is the next event to wait for.
                Tally::count(&tally.broken);
                conn = None;
                tokio::time::timeout(bound(30), serving.wait_for(|(now, _)| *now > killed))
                    .await
                    .expect("a new application process")
                    .map(drop)
                    .expect("the serving channel");
                continue;
            };
            match (reply.status, reply.problem().as_deref()) {
                (201, _) => break reply,
                (409, Some("request-in-progress")) => Tally::count(&tally.in_progress),
                (409, Some("outcome-unknown")) => {
                    Tally::count(&tally.outcome_unknown);
                    if !std::mem::replace(&mut unknown, true) {
                        Tally::count(&tally.unknown_keys);
                    }
                }
                (503, _) => Tally::count(&tally.unavailable),
                (status, _) => panic!("{key}: {status} {}", reply.text()),
            }
            // Paces the retries while a dead process's lease runs out (the refusal's
            // cause); the outcome does not depend on this pause, only the retry count.
            tokio::time::sleep(ms(20)).await;
        };
        if reply.header("idempotent-replayed").is_some() {
            Tally::count(&tally.replayed);
        }
        answered.send_modify(|seen| *seen += 1);
        answers.push((key, reply));
    }
    answers
}
