//! Replay and clients, through real HTTP (`axum::serve` on loopback): a record is
//! replayed only to the client that made it.

use crate::http_client::{Req, Served};
use crate::sockets::Store;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use tower_redlock::http::{key::header, replay::Replay, LockLayer};

/// A payments route whose receipts are numbered by the handler's runs.
fn payments(locker: tower_redlock::Redlock, runs: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/payments",
        post(move || {
            let runs = runs.clone();
            async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                (StatusCode::CREATED, format!("receipt {n}"))
            }
        })
        .route_layer(
            LockLayer::new(locker, header("Idempotency-Key"))
                .replay(Replay::per_client(header("Authorization"))),
        ),
    )
}

fn pay(client: Option<&str>) -> Req {
    let request = Req::post("/payments")
        .header("idempotency-key", "1")
        .json(r#"{"amount":100}"#);
    match client {
        Some(client) => request.header("authorization", &format!("Bearer {client}")),
        None => request,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_with_the_same_key_and_body_each_get_their_own_payment() {
    for store in Store::all() {
        let runs = Arc::new(AtomicUsize::new(0));
        let served = Served::start(payments(store.locker(), runs.clone())).await;
        let name = store.name();

        let alice = served.send(pay(Some("alice"))).await;
        assert_eq!(alice.status, 201, "{name}: {}", alice.text());
        let bob = served.send(pay(Some("bob"))).await;
        assert_eq!(bob.status, 201, "{name}: {}", bob.text());
        assert_eq!(
            bob.header("idempotent-replayed"),
            None,
            "{name}: alice's receipt went to bob"
        );
        assert_eq!(bob.text(), "receipt 2", "{name}");
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}");

        // Each client's retry is its own record, replayed.
        for (client, first) in [("alice", &alice), ("bob", &bob)] {
            let retry = served.send(pay(Some(client))).await;
            assert_eq!(
                retry.header("idempotent-replayed"),
                Some("true"),
                "{name}: {client}"
            );
            assert_eq!(retry.body, first.body, "{name}: {client}");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}");

        // A request that names no client is nobody's: refused, nothing runs.
        let anonymous = served.send(pay(None)).await;
        assert_eq!(anonymous.status, 400, "{name}: {}", anonymous.text());
        assert_eq!(anonymous.problem().as_deref(), Some("key-missing"));
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{name}");
    }
}
