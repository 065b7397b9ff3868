//! A refusal names a holder: concurrent requests through several instances over three
//! real `redis-server`s split the nodes' votes, and `Contention::Reject` still lets
//! exactly as many in as the lock admits. Every admitted handler stays inside until
//! every request has been admitted or refused, so the holders overlap without sleeps.

use crate::http_client::{Req, Served};
use crate::sockets::Store;

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::{Extension, Router};
use tokio::sync::Notify;
use tower_redlock::http::key::header;
use tower_redlock::http::{Contention, LockLayer};
use tower_redlock::LockMode;

/// Bound on things that happen promptly; only reached when a test fails.
const PROMPTLY: Duration = Duration::from_secs(10);

/// The requests of one trial: how many are in, how many were refused.
#[derive(Default)]
struct Trial {
    admitted: AtomicUsize,
    refused: AtomicUsize,
    changed: Notify,
}

impl Trial {
    fn answered(&self) -> usize {
        self.admitted.load(Ordering::SeqCst) + self.refused.load(Ordering::SeqCst)
    }

    /// Waits until `n` requests were admitted or refused.
    async fn until_answered(&self, n: usize) {
        let all = async {
            loop {
                let changed = self.changed.notified();
                if self.answered() >= n {
                    return;
                }
                changed.await;
            }
        };
        tokio::time::timeout(PROMPTLY, all)
            .await
            .unwrap_or_else(|_| panic!("{n} requests answered: {} are", self.answered()));
    }
}

/// The handler of a trial: in, then out once every request of the trial is answered.
async fn inside(Extension((trial, n)): Extension<(Arc<Trial>, usize)>) -> &'static str {
    trial.admitted.fetch_add(1, Ordering::SeqCst);
    trial.changed.notify_waiters();
    trial.until_answered(n).await;
    "done"
}

/// `trials` rounds of `n` concurrent requests for one key (a new one each round), spread
/// over `instances` lockers of `store` locking in `mode`: how often each number of
/// requests got in.
async fn admitted(
    store: &Store,
    instances: usize,
    mode: LockMode,
    n: usize,
    trials: usize,
) -> BTreeMap<usize, usize> {
    let mut served = Vec::new();
    let mut trial_slots = Vec::new();
    for _ in 0..instances {
        let slot = Arc::new(std::sync::Mutex::new((Arc::new(Trial::default()), n)));
        let app = Router::new()
            .route("/export", post(inside))
            .route_layer(
                LockLayer::new(store.locker(), header("x-tenant"))
                    .mode(mode)
                    .contention(Contention::Reject),
            )
            .layer(axum::middleware::from_fn({
                let slot = slot.clone();
                move |mut request: axum::extract::Request, next: axum::middleware::Next| {
                    let current = slot.lock().unwrap().clone();
                    request.extensions_mut().insert(current);
                    next.run(request)
                }
            }));
        served.push(Arc::new(Served::start(app).await));
        trial_slots.push(slot);
    }
    let mut seen = BTreeMap::new();
    for round in 0..trials {
        let trial = Arc::new(Trial::default());
        for slot in &trial_slots {
            *slot.lock().unwrap() = (trial.clone(), n);
        }
        let requests: Vec<_> = (0..n)
            .map(|i| {
                let (instance, trial) = (served[i % instances].clone(), trial.clone());
                tokio::spawn(async move {
                    let request = Req::post("/export").header("x-tenant", &format!("t{round}"));
                    let reply = instance.send(request).await;
                    if reply.status != 200 {
                        assert!(
                            [409, 429].contains(&reply.status),
                            "{}: {}",
                            reply.status,
                            reply.text()
                        );
                        trial.refused.fetch_add(1, Ordering::SeqCst);
                        trial.changed.notify_waiters();
                    }
                    reply.status == 200
                })
            })
            .collect();
        let mut ins = 0;
        for request in requests {
            ins += usize::from(request.await.unwrap());
        }
        assert_eq!(ins, trial.admitted.load(Ordering::SeqCst));
        *seen.entry(ins).or_default() += 1;
    }
    seen
}

fn counted(n: u32) -> LockMode {
    LockMode::Counted(NonZeroU32::new(n).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_get_every_permit_and_no_more() {
    let store = Store::redis(3);
    for requests in [3, 5] {
        let seen = admitted(&store, 2, counted(2), requests, 40).await;
        assert_eq!(
            seen,
            BTreeMap::from([(2, 40)]),
            "{requests} concurrent requests for 2 permits: how many got in, how often"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_exclusive_requests_let_exactly_one_in() {
    let store = Store::redis(3);
    let seen = admitted(&store, 5, LockMode::Exclusive, 5, 100).await;
    assert_eq!(
        seen,
        BTreeMap::from([(1, 100)]),
        "5 concurrent exclusive requests on 5 instances: how many got in, how often"
    );
}

/// The distribution, printed (BENCHMARKS.md):
/// `cargo test --all-features --test http splits::distribution -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement, not a test"]
async fn distribution() {
    let store = Store::redis(3);
    for (instances, mode, requests) in [
        (2, counted(2), 3),
        (2, counted(2), 5),
        (5, LockMode::Exclusive, 5),
    ] {
        let seen = admitted(&store, instances, mode, requests, 200).await;
        println!(
            "{requests} requests, {mode:?}, {instances} instances: admitted → trials {seen:?}"
        );
    }
}
