//! A handler that panics under the lock, through real HTTP (`axum::serve` on loopback),
//! with tower-http's `CatchPanicLayer` outside the lock layer and without: a panic is
//! not a disconnect. The section is over: never polled again, its lease released at
//! once, nothing recorded, not counted as finishing; the panic reaches the app.

use crate::http_client::{Req, Served};
use crate::sockets::Store;
use crate::support::eventually;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::{post, MethodRouter};
use axum::Router;
use futures_util::FutureExt;
use tokio::sync::Notify;
use tower_http::catch_panic::CatchPanicLayer;
use tower_redlock::http::{handlers_finishing, key::header, replay::Replay, LockLayer};

/// Bound on things that happen promptly; only reached when a test fails.
const PROMPTLY: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Charges {
    /// The next run panics.
    panic_next: AtomicBool,
    runs: AtomicUsize,
    /// A handler future that panicked was dropped.
    dropped: Notify,
}

/// The handler's future, by hand: it tells when it is dropped after its panic.
struct Charge {
    charges: Arc<Charges>,
    panicked: bool,
}

impl Future for Charge {
    type Output = StatusCode;

    fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<StatusCode> {
        self.charges.runs.fetch_add(1, Ordering::SeqCst);
        if self.charges.panic_next.swap(false, Ordering::SeqCst) {
            self.panicked = true;
            panic!("the payment handler panicked (a test)");
        }
        Poll::Ready(StatusCode::CREATED)
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if self.panicked {
            self.charges.dropped.notify_one();
        }
    }
}

/// `POST` of a `Charge`, for a route.
fn charge(charges: &Arc<Charges>) -> MethodRouter {
    let charges = charges.clone();
    post(move || Charge {
        charges: charges.clone(),
        panicked: false,
    })
}

/// `/payments` served by `route`, with `CatchPanicLayer` outside it or not.
fn app(route: MethodRouter, catch: bool) -> Router {
    let router = Router::new().route("/payments", route);
    if catch {
        router.layer(CatchPanicLayer::new())
    } else {
        router
    }
}

fn pay() -> Req {
    Req::post("/payments")
        .header("idempotency-key", "p1")
        .header("authorization", "Bearer alice")
        .json(r#"{"amount":100}"#)
}

/// Sends a payment whose handler panics: 500 under `CatchPanicLayer`, else the
/// connection closes without an answer. The panicked handler (and its lease) was
/// dropped by the panic's unwinding, before the answer: not left to run on.
async fn a_payment_panics(served: &Served, charges: &Charges, catch: bool, name: &str) {
    charges.panic_next.store(true, Ordering::SeqCst);
    let mut conn = served.connect().await;
    if catch {
        let reply = conn.send(pay()).await;
        assert_eq!(reply.status, 500, "{name}: {}", reply.text());
    } else {
        conn.write(&pay()).await;
        assert!(conn.closed_without_reply().await, "{name}");
    }
    assert!(
        charges.dropped.notified().now_or_never().is_some(),
        "{name}: the panicked handler was not dropped before the answer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_releases_its_lock_at_once_and_is_never_run_on() {
    for catch in [true, false] {
        for store in Store::all() {
            let name = format!("{}, catch-panic {catch}", store.name());
            let finishing = handlers_finishing();
            let charges = Arc::new(Charges::default());
            let lock = LockLayer::new(store.locker(), header("Idempotency-Key"));
            let served = Served::start(app(charge(&charges).route_layer(lock), catch)).await;

            a_payment_panics(&served, &charges, catch, &name).await;
            // The lock is free: the next request with the key runs (the layer refuses
            // while the key is held).
            let next = served.send(pay()).await;
            assert_eq!(next.status, 201, "{name}: {}", next.text());
            assert_eq!(charges.runs.load(Ordering::SeqCst), 2, "{name}");
            // Other tests of this process may be finishing handlers of their own.
            eventually("not counted as finishing", PROMPTLY, || {
                handlers_finishing() <= finishing
            })
            .await;
        }
    }
}

/// With replay, a panic's outcome is unknown, as a crash's: its pending marker stays,
/// and the retry is told `outcome-unknown` (not `request-in-progress`: the lock is free).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_under_replay_records_nothing_and_leaves_its_outcome_unknown() {
    for catch in [true, false] {
        for store in Store::all() {
            let name = format!("{}, catch-panic {catch}", store.name());
            let charges = Arc::new(Charges::default());
            let lock = LockLayer::new(store.locker(), header("Idempotency-Key"))
                .replay(Replay::per_client(header("Authorization")));
            let served = Served::start(app(charge(&charges).route_layer(lock), catch)).await;

            a_payment_panics(&served, &charges, catch, &name).await;
            let retry = served.send(pay()).await;
            assert_eq!(retry.status, 409, "{name}: {}", retry.text());
            assert_eq!(
                retry.problem().as_deref(),
                Some("outcome-unknown"),
                "{name}"
            );
            assert_eq!(retry.header("idempotent-replayed"), None, "{name}");
            assert_eq!(charges.runs.load(Ordering::SeqCst), 1, "{name}");
        }
    }
}
