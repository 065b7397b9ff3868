//! One execution per key through real HTTP: `axum::serve` on loopback ports, clients
//! that hang up mid-request, keep their connection alive for the next request, or
//! retry on a second instance; a lock taken by hand on the same name; a streamed body
//! whose lease is lost. In memory (two lockers over one `MemoryNode`) and on three
//! real `redis-server`s (two lockers: two instances).

use crate::http_client::{Cut, DropWatch, Req, Served};
use crate::support::{self, eventually, RedisServer};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use tokio::sync::{mpsc, watch, Notify};
use tower_redlock::axum::{LockKey, Locked};
use tower_redlock::http::{
    key::{header, path_param, Header, KeyExtractor, PathParam},
    replay::Replay,
    Contention, FinishOnDisconnectLayer, LockLayer, Scope,
};
use tower_redlock::{LeaseHandle, LockError, MemoryNode, Redlock, Resource};

/// Bound on things that happen promptly; only reached when a test fails.
const PROMPTLY: Duration = Duration::from_secs(10);

/// Where the instances keep their locks.
pub(crate) enum Store {
    Memory(MemoryNode),
    Redis(Vec<RedisServer>),
}

impl Store {
    pub(crate) fn all() -> Vec<Store> {
        vec![Store::Memory(MemoryNode::new()), Store::redis(3)]
    }

    pub(crate) fn redis(nodes: usize) -> Store {
        Store::Redis(RedisServer::start_many(nodes))
    }

    /// A locker of its own: one instance of the service.
    pub(crate) fn locker(&self) -> Redlock {
        match self {
            Store::Memory(node) => Redlock::new([node.clone()], support::patient()).unwrap(),
            Store::Redis(servers) => {
                Redlock::from_urls(servers.iter().map(RedisServer::url), support::patient())
                    .unwrap()
            }
        }
    }

    pub(crate) fn name(&self) -> String {
        match self {
            Store::Memory(_) => "memory".to_owned(),
            Store::Redis(servers) => format!("{} redis nodes", servers.len()),
        }
    }
}

/// A payment handler that charges first, then does its slow part (held at a gate).
#[derive(Clone)]
struct Payments {
    charges: Arc<AtomicUsize>,
    completed: Arc<AtomicUsize>,
    entered: Arc<Notify>,
    finished: Arc<Notify>,
    gate: watch::Sender<bool>,
}

impl Payments {
    fn new() -> Self {
        Payments {
            charges: Arc::default(),
            completed: Arc::default(),
            entered: Arc::default(),
            finished: Arc::default(),
            gate: watch::channel(false).0,
        }
    }

    fn app(&self, layer: impl LayerFor) -> Router {
        let payments = self.clone();
        layer.wrap(Router::new().route(
            "/payments",
            post(move || {
                let payments = payments.clone();
                async move { payments.pay().await }
            }),
        ))
    }

    async fn pay(&self) -> (StatusCode, String) {
        let charge = self.charges.fetch_add(1, Ordering::SeqCst) + 1;
        self.entered.notify_one();
        let _ = self.gate.subscribe().wait_for(|open| *open).await;
        self.completed.fetch_add(1, Ordering::SeqCst);
        self.finished.notify_one();
        (StatusCode::CREATED, format!("{{\"charge\":{charge}}}"))
    }

    fn open_gate(&self) {
        self.gate.send_replace(true);
    }
}

/// A lock layer, with or without replay, as a route layer.
trait LayerFor {
    fn wrap(self, router: Router) -> Router;
}

impl LayerFor for LockLayer<Header> {
    fn wrap(self, router: Router) -> Router {
        router.route_layer(self)
    }
}

impl LayerFor for LockLayer<tower_redlock::http::replay::Replaying<Header>> {
    fn wrap(self, router: Router) -> Router {
        router.route_layer(self)
    }
}

fn pay(key: &str) -> Req {
    Req::post("/payments")
        .header("idempotency-key", key)
        .json("{\"amount\":100}")
}

/// A client sends `request` to `served`, and hangs up once the handler is inside
/// (`entered`); returns when hyper has dropped the response future (`watch`).
async fn hang_up_inside(served: &Served, request: Req, entered: &Notify, watch: &DropWatch) {
    let mut conn = served.connect().await;
    conn.write(&request).await;
    entered.notified().await;
    drop(conn);
    watch.dropped.notified().await;
}

fn wait(timeout: Duration) -> Contention {
    Contention::Wait { timeout }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_is_charged_once_and_its_retry_gets_the_response() {
    for store in Store::all() {
        let payments = Payments::new();
        let watch = DropWatch::default();
        // Instance A refuses while the key is in flight; instance B waits for it.
        let a = Served::start(
            payments
                .app(
                    LockLayer::new(store.locker(), header("Idempotency-Key"))
                        .replay(Replay::global()),
                )
                .layer(watch.clone()),
        )
        .await;
        let b = Served::start(
            payments.app(
                LockLayer::new(store.locker(), header("Idempotency-Key"))
                    .contention(wait(PROMPTLY))
                    .replay(Replay::global()),
            ),
        )
        .await;

        // The client times out and hangs up mid-handler.
        hang_up_inside(&a, pay("k1"), &payments.entered, &watch).await;

        let retry = a.send(pay("k1")).await;
        assert_eq!(retry.status, 409, "{}: {}", store.name(), retry.text());
        assert_eq!(retry.problem().as_deref(), Some("request-in-progress"));
        assert!(retry.header("retry-after").is_some());

        let elsewhere = tokio::spawn({
            let b_addr = b.addr;
            async move {
                crate::http_client::Conn::open(b_addr)
                    .await
                    .send(pay("k1"))
                    .await
            }
        });
        payments.open_gate();
        let replayed = elsewhere.await.unwrap();
        assert_eq!(
            replayed.status,
            201,
            "{}: {}",
            store.name(),
            replayed.text()
        );
        assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
        assert_eq!(replayed.text(), "{\"charge\":1}");
        assert_eq!(
            payments.charges.load(Ordering::SeqCst),
            1,
            "{}",
            store.name()
        );
        assert_eq!(
            payments.completed.load(Ordering::SeqCst),
            1,
            "{}",
            store.name()
        );

        // And once more on A, now that the first attempt is over.
        let again = a.send(pay("k1")).await;
        assert_eq!(again.status, 201);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(payments.charges.load(Ordering::SeqCst), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_up_does_not_cut_the_handler_in_half() {
    for store in Store::all() {
        let payments = Payments::new();
        let watch = DropWatch::default();
        let locker = store.locker();
        let served = Served::start(
            payments
                .app(LockLayer::new(locker.clone(), header("Idempotency-Key")))
                .layer(watch.clone()),
        )
        .await;
        runs_whole_after_its_client_left(&served, "k2", &payments, &watch, &locker, &store).await;
    }
}

/// A client hangs up inside the handler: the handler still holds its lease (a second
/// request is refused), runs to its end once let go, and then releases it.
async fn runs_whole_after_its_client_left(
    served: &Served,
    key: &str,
    payments: &Payments,
    watch: &DropWatch,
    locker: &Redlock,
    store: &Store,
) {
    hang_up_inside(served, pay(key), &payments.entered, watch).await;
    // Counted while it runs on (other tests of this process may add theirs).
    assert!(tower_redlock::http::handlers_finishing() >= 1);
    let during = served.send(pay(key)).await;
    assert_eq!(during.status, 409, "{}: {}", store.name(), during.text());
    assert_eq!(during.problem().as_deref(), Some("lock-held"));
    payments.open_gate();
    payments.finished.notified().await;
    let completed = payments.completed.load(Ordering::SeqCst);
    assert_eq!(completed, 1, "{}", store.name());
    eventually("the finished handler's lease is released", PROMPTLY, || {
        locker.local_resources() == 0
    })
    .await;
    let after = served.send(pay(key)).await;
    assert_eq!(after.status, 201, "{}: {}", store.name(), after.text());
}

struct OrderId;

impl LockKey for OrderId {
    type Extractor = PathParam;

    fn extractor() -> PathParam {
        path_param("id")
    }
}

/// Orders paid through the layer and through the `Locked` extractor.
fn orders(locker: Redlock) -> Router {
    let layered = Router::new()
        .route(
            "/orders/{id}/pay",
            post(|Path(id): Path<String>| async move { format!("paid {id}") }),
        )
        .route_layer(LockLayer::new(locker.clone(), path_param("id")));
    let extracted = Router::new()
        .route(
            "/orders/{id}/ship",
            post(|lock: Locked<OrderId>| async move {
                format!("shipped under {}", lock.fencing_token())
            }),
        )
        .with_state(locker);
    layered.merge(extracted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequential_client_never_meets_its_own_finished_request() {
    for store in [
        Store::Memory(MemoryNode::new()),
        Store::redis(1),
        Store::redis(3),
    ] {
        let served = Served::start(orders(store.locker())).await;
        for route in ["/orders/seq/pay", "/orders/seq/ship"] {
            // One keep-alive connection, each request sent once the last was read.
            let mut conn = served.connect().await;
            for i in 0..30 {
                let reply = conn.send(Req::post(route)).await;
                assert_eq!(
                    reply.status,
                    200,
                    "{} {route} #{i}: {}",
                    store.name(),
                    reply.text()
                );
            }
            // A connection per request.
            for i in 0..15 {
                let reply = served.send(Req::post(route)).await;
                assert_eq!(
                    reply.status,
                    200,
                    "{} {route} new #{i}: {}",
                    store.name(),
                    reply.text()
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_taken_by_hand_under_the_documented_spelling_excludes_the_layer() {
    for store in Store::all() {
        let locker = store.locker();
        let entered = Arc::new(Notify::new());
        let gate = watch::channel(false).0;
        let app = {
            let (entered, gate) = (entered.clone(), gate.clone());
            Router::new()
                .route(
                    "/orders/{id}/ship",
                    post(move || {
                        let (entered, gate) = (entered.clone(), gate.clone());
                        async move {
                            entered.notify_one();
                            let _ = gate.subscribe().wait_for(|open| *open).await;
                            "shipped"
                        }
                    }),
                )
                .route_layer(
                    LockLayer::new(locker.clone(), path_param("id")).scope(Scope::shared("order")),
                )
        };
        let served = Served::start(app).await;

        // Held by hand, as the docs spell it: the layer is refused.
        let by_hand = locker.try_acquire("order:42").await.unwrap();
        assert_eq!(by_hand.resource(), &Resource::new("order").join("42"));
        let refused = served.send(Req::post("/orders/42/ship")).await;
        assert_eq!(refused.status, 409, "{}: {}", store.name(), refused.text());
        by_hand.release().await;

        // Held by the layer: the hand is refused, alone and in a set.
        let addr = served.addr;
        let request = tokio::spawn(async move {
            crate::http_client::Conn::open(addr)
                .await
                .send(Req::post("/orders/42/ship"))
                .await
        });
        entered.notified().await;
        assert!(matches!(
            locker.try_acquire("order:42").await,
            Err(LockError::Held { .. })
        ));
        assert!(matches!(
            locker.try_acquire_all(["order:41", "order:42"]).await,
            Err(LockError::Held { .. })
        ));
        gate.send_replace(true);
        assert_eq!(request.await.unwrap().status, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_ends_with_an_error_once_its_lease_is_lost() {
    let server = RedisServer::start();
    let locker = Redlock::from_urls(
        [server.url()],
        support::patient().ttl(Duration::from_secs(3)),
    )
    .unwrap();
    let (chunks_tx, chunks_rx) = mpsc::channel::<Bytes>(1);
    let chunks_rx = Arc::new(Mutex::new(Some(chunks_rx)));
    let (lease_tx, mut lease_rx) = mpsc::channel::<LeaseHandle>(1);
    let app = Router::new()
        .route(
            "/export",
            post(move |Extension(lease): Extension<LeaseHandle>| {
                let rx = chunks_rx.lock().unwrap().take().expect("one request");
                let lease_tx = lease_tx.clone();
                async move {
                    lease_tx.send(lease).await.unwrap();
                    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                        rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx))
                    });
                    Body::from_stream(stream)
                }
            }),
        )
        .route_layer(LockLayer::new(locker.clone(), header("Idempotency-Key")));
    let served = Served::start(app).await;
    let mut conn = served.connect().await;
    conn.write(&Req::post("/export").header("idempotency-key", "e1"))
        .await;
    let lease = lease_rx.recv().await.unwrap();
    let (status, headers) = conn.read_head().await;
    assert_eq!(status, 200);
    assert_eq!(
        headers.get("transfer-encoding").map(String::as_str),
        Some("chunked")
    );
    chunks_tx.send(Bytes::from_static(b"first")).await.unwrap();
    assert_eq!(conn.read_chunk().await, Ok(Some(b"first".to_vec())));

    // Someone deletes the key: the watchdog finds it gone and the lease is lost.
    server.cmd(&["DEL", &format!("redlock:{{{}}}", lease.resource().as_str())]);
    lease.lost().await;
    // The body ends with an error, so hyper cuts the response short: the client can
    // tell it is incomplete, and nothing more is produced under the lost lease.
    assert_eq!(conn.read_chunk().await, Err(Cut));
    eventually("the body was dropped", PROMPTLY, || chunks_tx.is_closed()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_for_its_lock_is_dropped_with_its_client() {
    // Not yet in its critical section: a client that leaves takes its request along.
    let store = Store::Memory(MemoryNode::new());
    let locker = store.locker();
    let watch = DropWatch::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = {
        let runs = runs.clone();
        Router::new()
            .route(
                "/jobs",
                post(move || {
                    runs.fetch_add(1, Ordering::SeqCst);
                    async { "ran" }
                }),
            )
            .route_layer(
                LockLayer::new(locker.clone(), header("Idempotency-Key"))
                    .contention(wait(Duration::from_secs(60))),
            )
            .layer(watch.clone())
    };
    let served = Served::start(app).await;
    let held = locker
        .try_acquire(Resource::new("POST").join("/jobs").join("w1"))
        .await
        .unwrap();
    let mut conn = served.connect().await;
    conn.write(&Req::post("/jobs").header("idempotency-key", "w1"))
        .await;
    eventually("the request waits for the lock", PROMPTLY, || {
        locker.metrics().waits > 0
    })
    .await;
    drop(conn);
    watch.dropped.notified().await;
    held.release().await;
    eventually("nothing left behind", PROMPTLY, || {
        locker.local_resources() == 0
    })
    .await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "a waiting request never runs once its client left"
    );
}

#[derive(serde::Deserialize)]
struct Charge {
    amount: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_mistake_does_not_burn_its_idempotency_key() {
    for store in Store::all() {
        let runs = Arc::new(AtomicUsize::new(0));
        let app = {
            let runs = runs.clone();
            Router::new()
                .route(
                    "/charges",
                    post(move |axum::Json(charge): axum::Json<Charge>| {
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        async move {
                            if charge.amount == 0 {
                                // The handler's own refusal (card declined): recorded.
                                return (StatusCode::PAYMENT_REQUIRED, "declined".to_owned());
                            }
                            (StatusCode::CREATED, format!("run {run}: {}", charge.amount))
                        }
                    }),
                )
                .route_layer(
                    LockLayer::new(store.locker(), header("Idempotency-Key"))
                        .replay(Replay::global()),
                )
        };
        let served = Served::start(app).await;
        let charge = |key: &str| Req::post("/charges").header("idempotency-key", key);

        // No Content-Type: axum refuses (415) before the handler; the corrected request runs.
        let refused = served.send(charge("m1")).await;
        assert_eq!(refused.status, 415, "{}: {}", store.name(), refused.text());
        let fixed = served.send(charge("m1").json("{\"amount\":100}")).await;
        assert_eq!(fixed.status, 201, "{}: {}", store.name(), fixed.text());
        assert_eq!(fixed.header("idempotent-replayed"), None);

        // A type error (422), then the corrected body: it runs, not `idempotency-key-reused`.
        let wrong = served.send(charge("m2").json("{\"amount\":\"100\"}")).await;
        assert_eq!(wrong.status, 422, "{}: {}", store.name(), wrong.text());
        let fixed = served.send(charge("m2").json("{\"amount\":100}")).await;
        assert_eq!(fixed.status, 201, "{}: {}", store.name(), fixed.text());

        // The same parameters written differently are the same request: replayed.
        let spaced = served.send(charge("m2").json("{ \"amount\": 100 }")).await;
        assert_eq!(spaced.status, 201, "{}: {}", store.name(), spaced.text());
        assert_eq!(spaced.header("idempotent-replayed"), Some("true"));
        assert_eq!(spaced.text(), fixed.text());

        // The handler's own 4xx is its outcome: recorded and replayed.
        let declined = served.send(charge("m3").json("{\"amount\":0}")).await;
        assert_eq!(declined.status, 402);
        let again = served.send(charge("m3").json("{\"amount\":0}")).await;
        assert_eq!(again.status, 402);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(runs.load(Ordering::SeqCst), 3, "{}", store.name());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_lets_running_sections_finish_then_releases_what_is_left() {
    for store in Store::all() {
        let payments = Payments::new();
        let watch = DropWatch::default();
        let locker = store.locker();
        let served = Served::start(
            payments
                .app(
                    LockLayer::new(locker.clone(), header("Idempotency-Key"))
                        .replay(Replay::global()),
                )
                .layer(watch.clone()),
        )
        .await;
        // A handler runs on after its client left; the deploy starts.
        hang_up_inside(&served, pay("d1"), &payments.entered, &watch).await;
        let drain = tokio::spawn({
            let locker = locker.clone();
            async move { locker.drain(PROMPTLY).await }
        });
        // New requests are turned away to another instance.
        eventually_draining(&locker).await;
        let refused = served.send(pay("d2")).await;
        assert_eq!(refused.status, 503, "{}: {}", store.name(), refused.text());
        assert_eq!(refused.problem().as_deref(), Some("lock-unavailable"));
        // The running section finishes and records; the drain ends with nothing left.
        payments.open_gate();
        let drained = drain.await.unwrap();
        assert_eq!(drained.released_at_deadline, 0, "{}", store.name());
        assert_eq!(payments.completed.load(Ordering::SeqCst), 1);
        assert_eq!(locker.local_resources(), 0);
        // Another instance replays the recorded response at once.
        let other = Served::start(payments.app(
            LockLayer::new(store.locker(), header("Idempotency-Key")).replay(Replay::global()),
        ))
        .await;
        let replayed = other.send(pay("d1")).await;
        assert_eq!(
            replayed.status,
            201,
            "{}: {}",
            store.name(),
            replayed.text()
        );
        assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_releases_at_its_deadline_what_is_still_held() {
    for store in Store::all() {
        let payments = Payments::new(); // its gate never opens
        let locker = store.locker();
        let served =
            Served::start(payments.app(LockLayer::new(locker.clone(), header("Idempotency-Key"))))
                .await;
        let request = tokio::spawn({
            let addr = served.addr;
            async move {
                crate::http_client::Conn::open(addr)
                    .await
                    .send(pay("d3"))
                    .await
            }
        });
        payments.entered.notified().await;
        let drained = locker.drain(Duration::from_millis(1)).await;
        assert_eq!(drained.released_at_deadline, 1, "{}", store.name());
        // Released on the nodes when the drain returns: another instance takes it now.
        let other = store.locker();
        let resource = Resource::new("POST").join("/payments").join("d3");
        let lease = other.try_acquire(resource).await;
        assert!(lease.is_ok(), "{}: {lease:?}", store.name());
        // The handler was stopped (`OnLost::Abort`) and its client told.
        let stopped = request.await.unwrap();
        assert_eq!(stopped.status, 503, "{}: {}", store.name(), stopped.text());
        assert_eq!(stopped.problem().as_deref(), Some("lock-lost"));
        assert_eq!(payments.completed.load(Ordering::SeqCst), 0);
    }
}

/// Waits until `locker` refuses new leases.
async fn eventually_draining(locker: &Redlock) {
    let probe = Resource::new("probe");
    crate::support::eventually_async("the locker drains", PROMPTLY, || {
        let locker = locker.clone();
        let probe = probe.clone();
        async move {
            matches!(
                locker.try_acquire(probe).await,
                Err(LockError::Draining { .. })
            )
        }
    })
    .await;
}

struct PaymentKey;

impl LockKey for PaymentKey {
    type Extractor = Header;

    fn extractor() -> Header {
        header("Idempotency-Key")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_handler_under_finish_on_disconnect_runs_whole() {
    for store in Store::all() {
        let payments = Payments::new();
        let watch = DropWatch::default();
        let locker = store.locker();
        let app = {
            let payments = payments.clone();
            Router::new()
                .route(
                    "/payments",
                    post(move |lock: Locked<PaymentKey>| {
                        let payments = payments.clone();
                        async move {
                            let answer = payments.pay().await;
                            drop(lock);
                            answer
                        }
                    }),
                )
                .route_layer(FinishOnDisconnectLayer::new())
                .with_state(locker.clone())
                .layer(watch.clone())
        };
        let served = Served::start(app).await;
        runs_whole_after_its_client_left(&served, "l1", &payments, &watch, &locker, &store).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_the_handler_reads_as_one_value_lock_one_resource() {
    for store in Store::all() {
        let entered = Arc::new(Notify::new());
        let gate = watch::channel(false).0;
        let app = {
            let (entered, gate) = (entered.clone(), gate.clone());
            Router::new()
                .route(
                    "/orders/{id}/pay",
                    post(move |Path(id): Path<u64>| {
                        let (entered, gate) = (entered.clone(), gate.clone());
                        async move {
                            entered.notify_one();
                            let _ = gate.subscribe().wait_for(|open| *open).await;
                            format!("paid {id}")
                        }
                    }),
                )
                .route_layer(LockLayer::new(
                    store.locker(),
                    path_param("id").parse::<u64>(),
                ))
        };
        let served = Served::start(app).await;
        let addr = served.addr;
        let first = tokio::spawn(async move {
            crate::http_client::Conn::open(addr)
                .await
                .send(Req::post("/orders/007/pay"))
                .await
        });
        entered.notified().await;
        // The handler sees order 7 in both: one lock.
        let same = served.send(Req::post("/orders/7/pay")).await;
        assert_eq!(same.status, 409, "{}: {}", store.name(), same.text());
        assert_eq!(same.problem().as_deref(), Some("lock-held"));
        // Not an order id at all: refused as the handler's extractor would.
        let bad = served.send(Req::post("/orders/seven/pay")).await;
        assert_eq!(bad.status, 400, "{}: {}", store.name(), bad.text());
        assert_eq!(bad.problem().as_deref(), Some("key-invalid"));
        gate.send_replace(true);
        assert_eq!(first.await.unwrap().text(), "paid 7");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_execution_is_told_which_attempt_was_interrupted() {
    use tower_redlock::http::{replay::UnknownOutcome, InterruptedAttempt};
    use tower_redlock::FencingToken;

    for store in Store::all() {
        let locker = match &store {
            Store::Memory(node) => Redlock::new(
                [node.clone()],
                support::patient().ttl(Duration::from_secs(3)),
            )
            .unwrap(),
            Store::Redis(servers) => Redlock::from_urls(
                servers.iter().map(RedisServer::url),
                support::patient().ttl(Duration::from_secs(3)),
            )
            .unwrap(),
        };
        // The payment provider: charges by the token of the attempt that made them.
        let charges: Arc<Mutex<Vec<FencingToken>>> = Arc::default();
        let entered = Arc::new(Notify::new());
        let app = {
            let (charges, entered) = (charges.clone(), entered.clone());
            Router::new()
                .route(
                    "/payments",
                    post(
                        move |Extension(lease): Extension<LeaseHandle>,
                              interrupted: Option<Extension<InterruptedAttempt>>| {
                            let (charges, entered) = (charges.clone(), entered.clone());
                            async move {
                                if let Some(Extension(attempt)) = interrupted {
                                    let known = charges.lock().unwrap().contains(&attempt.fencing_token());
                                    if known {
                                        return (StatusCode::CREATED, format!("reconciled {}", attempt.fencing_token()));
                                    }
                                }
                                charges.lock().unwrap().push(lease.fencing_token());
                                if charges.lock().unwrap().len() == 1 {
                                    // The first attempt is cut after its charge.
                                    entered.notify_one();
                                    std::future::pending::<()>().await;
                                }
                                (StatusCode::CREATED, format!("charged {}", lease.fencing_token()))
                            }
                        },
                    ),
                )
                .route_layer(
                    LockLayer::new(locker.clone(), header("Idempotency-Key")).replay(
                        Replay::global()
                            .unknown_outcome(UnknownOutcome::ReexecuteAfter(Duration::from_millis(1))),
                    ),
                )
        };
        let served = Served::start(app).await;
        let addr = served.addr;
        let first = tokio::spawn(async move {
            crate::http_client::Conn::open(addr)
                .await
                .send(pay("i1"))
                .await
        });
        entered.notified().await;
        let first_token = charges.lock().unwrap()[0];
        // The attempt loses its lock (as a paused or partitioned process would).
        let lock_key = format!(
            "redlock:{{{}}}",
            Resource::new("POST").join("/payments").join("i1").as_str()
        );
        match &store {
            Store::Memory(node) => node.delete(&lock_key),
            Store::Redis(servers) => servers.iter().for_each(|s| {
                s.cmd(&["DEL", &lock_key]);
            }),
        }
        let cut = first.await.unwrap();
        assert_eq!(cut.status, 503, "{}: {}", store.name(), cut.text());
        assert_eq!(cut.problem().as_deref(), Some("lock-lost"));

        // Retries: `outcome-unknown` for the configured time, then the next execution
        // runs, told which attempt was interrupted, and reconciles instead of charging.
        let mut answer = served.send(pay("i1")).await;
        for _ in 0..1000 {
            if answer.status != 409 {
                break;
            }
            assert_eq!(
                answer.problem().as_deref(),
                Some("outcome-unknown"),
                "{}",
                store.name()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
            answer = served.send(pay("i1")).await;
        }
        assert_eq!(answer.status, 201, "{}: {}", store.name(), answer.text());
        assert_eq!(
            answer.text(),
            format!("reconciled {first_token}"),
            "{}",
            store.name()
        );
        assert_eq!(
            charges.lock().unwrap().len(),
            1,
            "{}: charged once",
            store.name()
        );
    }
}
