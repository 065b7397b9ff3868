//! Shared and counted locks through real HTTP: readers beside readers and never beside a
//! writer, a waiting writer served before later readers, at most `n` requests per key
//! across two instances (the rest hear 429 `limit-reached`), and the configurations the
//! layer refuses when built. In memory (two lockers over one `MemoryNode`) and on three
//! real `redis-server`s.

use crate::http_client::{Req, Served};
use crate::sockets::Store;
use crate::support::eventually;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Extension, Router};
use tokio::sync::{watch, Notify};
use tower::ServiceExt;
use tower_redlock::axum::{LockKey, Locked};
use tower_redlock::http::key::{header, json_fields, Header};
use tower_redlock::http::replay::Replay;
use tower_redlock::http::{Contention, LockLayer, Scope};
use tower_redlock::{LockMode, Redlock};

/// Bound on things that happen promptly; only reached when a test fails.
const PROMPTLY: Duration = Duration::from_secs(10);

/// Where the handlers run: each request names its door (`x-door`) and stays inside
/// until the test opens it. Counts who is inside, and the order they came in.
#[derive(Clone, Default)]
struct Room {
    inside: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    entries: Arc<Mutex<Vec<String>>>,
    doors: Arc<Mutex<HashMap<String, watch::Sender<bool>>>>,
    changed: Arc<Notify>,
}

impl Room {
    fn door(&self, id: &str) -> watch::Sender<bool> {
        let mut doors = self.doors.lock().unwrap();
        doors
            .entry(id.to_owned())
            .or_insert_with(|| watch::channel(false).0)
            .clone()
    }

    fn open(&self, id: &str) {
        self.door(id).send_replace(true);
    }

    fn entries(&self) -> Vec<String> {
        self.entries.lock().unwrap().clone()
    }

    /// Waits until `n` handlers are inside at once.
    async fn until_inside(&self, n: usize) {
        tokio::time::timeout(PROMPTLY, async {
            loop {
                let changed = self.changed.notified();
                if self.inside.load(Ordering::SeqCst) == n {
                    return;
                }
                changed.await;
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{n} handlers inside: {} are",
                self.inside.load(Ordering::SeqCst)
            )
        });
    }
}

async fn visit(Extension(room): Extension<Room>, headers: HeaderMap) -> &'static str {
    let id = headers["x-door"].to_str().unwrap().to_owned();
    let mut door = room.door(&id).subscribe();
    room.entries.lock().unwrap().push(id);
    let now = room.inside.fetch_add(1, Ordering::SeqCst) + 1;
    room.most.fetch_max(now, Ordering::SeqCst);
    room.changed.notify_waiters();
    let _ = door.wait_for(|open| *open).await;
    room.inside.fetch_sub(1, Ordering::SeqCst);
    room.changed.notify_waiters();
    "done"
}

/// `GET` and `PUT /reports/{id}`: reads shared, writes exclusive, on one resource.
fn reports(locker: Redlock, room: &Room, contention: Contention) -> Router {
    let layer = LockLayer::new(locker, header("x-report"))
        .scope(Scope::shared("report"))
        .contention(contention)
        .read_mode(LockMode::Shared);
    Router::new()
        .route("/report", get(visit).put(visit))
        .route_layer(layer)
        .layer(Extension(room.clone()))
}

fn read(door: &str) -> Req {
    Req::get("/report")
        .header("x-report", "7")
        .header("x-door", door)
}

fn write(door: &str) -> Req {
    Req::put("/report")
        .header("x-report", "7")
        .header("x-door", door)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readers_share_a_report_and_a_writer_excludes_them_across_instances() {
    for store in Store::all() {
        let name = store.name();
        let room = Room::default();
        let a = Arc::new(Served::start(reports(store.locker(), &room, Contention::Reject)).await);
        let b = Arc::new(Served::start(reports(store.locker(), &room, Contention::Reject)).await);

        // Two readers, one per instance, inside at once.
        let first = tokio::spawn({
            let a = a.clone();
            async move { a.send(read("r1")).await }
        });
        let second = tokio::spawn({
            let b = b.clone();
            async move { b.send(read("r2")).await }
        });
        room.until_inside(2).await;

        // A writer meets them.
        let refused = a.send(write("w-refused")).await;
        assert_eq!(refused.status, 409, "{name}: {}", refused.text());
        assert_eq!(refused.problem().as_deref(), Some("lock-held"), "{name}");
        assert!(refused.header("retry-after").is_some(), "{name}");

        room.open("r1");
        room.open("r2");
        assert_eq!(first.await.unwrap().status, 200, "{name}");
        assert_eq!(second.await.unwrap().status, 200, "{name}");

        // A writer inside: readers on either instance are refused.
        let writer = tokio::spawn({
            let b = b.clone();
            async move { b.send(write("w1")).await }
        });
        room.until_inside(1).await;
        for (instance, door) in [(&a, "r-refused-a"), (&b, "r-refused-b")] {
            let refused = instance.send(read(door)).await;
            assert_eq!(refused.status, 409, "{name}: {}", refused.text());
            assert_eq!(refused.problem().as_deref(), Some("lock-held"), "{name}");
        }
        room.open("w1");
        assert_eq!(writer.await.unwrap().status, 200, "{name}");

        // Free again: a reader goes in.
        room.open("r3");
        assert_eq!(a.send(read("r3")).await.status, 200, "{name}");
        assert_eq!(room.most.load(Ordering::SeqCst), 2, "{name}");
        let entries = room.entries();
        assert!(
            !entries.iter().any(|door| door.contains("refused")),
            "{name}: a refused request ran: {entries:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_writer_is_served_before_readers_that_come_after_it() {
    for store in Store::all() {
        let name = store.name();
        let room = Room::default();
        let wait = Contention::Wait { timeout: PROMPTLY };
        let readers = Arc::new(Served::start(reports(store.locker(), &room, wait)).await);
        let writer_locker = store.locker();
        let writers = Arc::new(Served::start(reports(writer_locker.clone(), &room, wait)).await);

        let first = tokio::spawn({
            let readers = readers.clone();
            async move { readers.send(read("r1")).await }
        });
        room.until_inside(1).await;
        let writer = tokio::spawn({
            let writers = writers.clone();
            async move { writers.send(write("w1")).await }
        });
        // The writer has met the reader twice: its second attempt, made once it is
        // subscribed, queues it and leaves its intent (the first joins nothing, so that
        // no hand-off to it goes unheard).
        eventually("the writer to queue", PROMPTLY, || {
            writer_locker.metrics().contended >= 2
        })
        .await;
        let late = tokio::spawn({
            let readers = readers.clone();
            async move { readers.send(read("r2")).await }
        });
        room.open("r1");
        assert_eq!(first.await.unwrap().status, 200, "{name}");
        room.until_inside(1).await;
        room.open("w1");
        assert_eq!(writer.await.unwrap().status, 200, "{name}");
        room.open("r2");
        assert_eq!(late.await.unwrap().status, 200, "{name}");
        assert_eq!(room.entries(), ["r1", "w1", "r2"], "{name}");
        assert_eq!(room.most.load(Ordering::SeqCst), 1, "{name}");
    }
}

/// `POST /exports`: at most 3 per tenant.
fn exports(locker: Redlock, room: &Room) -> Router {
    let layer = LockLayer::new(locker, header("x-tenant"))
        .scope(Scope::shared("export"))
        .mode(LockMode::counted(3).unwrap());
    Router::new()
        .route("/exports", post(visit).route_layer(layer))
        .layer(Extension(room.clone()))
}

fn export(tenant: &str, door: &str) -> Req {
    Req::post("/exports")
        .header("x-tenant", tenant)
        .header("x-door", door)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_most_three_exports_per_tenant_across_instances_the_fourth_hears_429() {
    for store in Store::all() {
        let name = store.name();
        let room = Room::default();
        let a = Arc::new(Served::start(exports(store.locker(), &room)).await);
        let b = Arc::new(Served::start(exports(store.locker(), &room)).await);

        let mut running = Vec::new();
        for (index, instance) in [&a, &b, &a].into_iter().enumerate() {
            let instance = instance.clone();
            running.push(tokio::spawn(async move {
                instance
                    .send(export("acme", &format!("acme-{index}")))
                    .await
            }));
        }
        room.until_inside(3).await;

        for instance in [&a, &b] {
            let refused = instance.send(export("acme", "acme-refused")).await;
            assert_eq!(refused.status, 429, "{name}: {}", refused.text());
            assert_eq!(
                refused.problem().as_deref(),
                Some("limit-reached"),
                "{name}"
            );
            assert_eq!(
                refused.header("content-type"),
                Some("application/problem+json"),
                "{name}"
            );
            assert!(refused.header("retry-after").is_some(), "{name}");
        }

        // Another tenant has permits of its own.
        room.open("other");
        assert_eq!(b.send(export("other", "other")).await.status, 200, "{name}");

        // One permit back: the next export of the tenant runs.
        room.open("acme-0");
        assert_eq!(running.remove(0).await.unwrap().status, 200, "{name}");
        room.open("acme-3");
        assert_eq!(b.send(export("acme", "acme-3")).await.status, 200, "{name}");

        room.open("acme-1");
        room.open("acme-2");
        for reply in running {
            assert_eq!(reply.await.unwrap().status, 200, "{name}");
        }
        assert_eq!(
            room.most.load(Ordering::SeqCst),
            4,
            "{name}: 3 acme + 1 other"
        );
        assert!(
            !room.entries().contains(&"acme-refused".to_owned()),
            "{name}"
        );
    }
}

struct ReportLock;

impl LockKey for ReportLock {
    type Extractor = Header;

    fn extractor() -> Header {
        header("x-report")
    }

    fn scope() -> Scope {
        Scope::shared("report")
    }

    fn mode() -> LockMode {
        LockMode::Shared
    }
}

async fn read_locked(
    _lock: Locked<ReportLock>,
    room: Extension<Room>,
    h: HeaderMap,
) -> &'static str {
    visit(room, h).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn locked_readers_share_and_exclude_the_layer_s_writer() {
    let store = Store::redis(3);
    let room = Room::default();
    let locker = store.locker();
    let app = Router::new()
        .route("/report", get(read_locked))
        .route(
            "/report",
            axum::routing::put(visit).route_layer(
                LockLayer::new(locker.clone(), header("x-report")).scope(Scope::shared("report")),
            ),
        )
        .layer(Extension(room.clone()))
        .with_state(locker);
    let served = Arc::new(Served::start(app).await);
    let readers: Vec<_> = ["r1", "r2"]
        .into_iter()
        .map(|door| {
            let served = served.clone();
            tokio::spawn(async move { served.send(read(door)).await })
        })
        .collect();
    room.until_inside(2).await;
    let refused = served.send(write("w-refused")).await;
    assert_eq!(refused.status, 409, "{}", refused.text());
    room.open("r1");
    room.open("r2");
    for reader in readers {
        assert_eq!(reader.await.unwrap().status, 200);
    }
}

#[tokio::test]
async fn the_layer_refuses_shared_locks_with_replay_and_with_several_keys() {
    let locker = Redlock::in_memory();

    let replaying = LockLayer::new(locker.clone(), header("idempotency-key"))
        .read_mode(LockMode::Shared)
        .try_replay(Replay::global());
    assert!(replaying.is_err(), "replay over shared reads was accepted");

    let mode_after_replay = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        LockLayer::new(locker.clone(), header("idempotency-key"))
            .replay(Replay::global())
            .mode(LockMode::Shared)
    }));
    assert!(
        mode_after_replay.is_err(),
        "shared mode on a replaying layer was accepted"
    );

    // A lease over several resources is exclusive: a shared route with a multi-key
    // extractor is the server's mistake, and nothing runs.
    let ran = Arc::new(AtomicUsize::new(0));
    let app = Router::new().route(
        "/transfer",
        post({
            let ran = ran.clone();
            move || async move {
                ran.fetch_add(1, Ordering::SeqCst);
            }
        })
        .route_layer(LockLayer::new(locker, json_fields(["/from", "/to"])).mode(LockMode::Shared)),
    );
    let request = axum::http::Request::post("/transfer")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(r#"{"from":"a","to":"b"}"#))
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}
