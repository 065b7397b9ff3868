//! The guard in handlers: `LayerLease`, `RequestLeases` and `Locked<K>` each fence
//! every resource they hold with one call, in the handler's own transaction.

use axum::extract::{FromRef, State};
use axum::routing::post;
use axum::{Extension, Router};
use http::{Request, StatusCode};
use sqlx::PgPool;
use tower::ServiceExt;
use tower_redlock::axum::{LayerLease, LockKey, Locked};
use tower_redlock::fence::{self, Fenced};
use tower_redlock::http::{
    key::{header, path_param, Header},
    LockLayer, RequestLeases, Scope,
};
use tower_redlock::{FencingToken, Redlock, Resource};

use crate::support::postgres::TestDatabase;

#[derive(Clone)]
struct App {
    locker: Redlock,
    pool: PgPool,
}

impl FromRef<App> for Redlock {
    fn from_ref(app: &App) -> Redlock {
        app.locker.clone()
    }
}

struct Account;

impl LockKey for Account {
    type Extractor = Header;

    fn extractor() -> Header {
        header("x-account")
    }

    fn scope() -> Scope {
        Scope::shared("account")
    }
}

async fn fenced(pool: &PgPool, held: &impl Fenced) -> StatusCode {
    let mut tx = pool.begin().await.unwrap();
    match fence::postgres::advance(&mut tx, held).await {
        Ok(()) => {
            tx.commit().await.unwrap();
            StatusCode::OK
        }
        Err(error) if error.is_stale() => StatusCode::CONFLICT,
        Err(error) => panic!("{error}"),
    }
}

async fn with_layer_lease(State(app): State<App>, lease: LayerLease) -> StatusCode {
    fenced(&app.pool, &lease).await
}

async fn with_locked(
    State(app): State<App>,
    Extension(leases): Extension<RequestLeases>,
    lock: Locked<Account>,
) -> StatusCode {
    // The extractor's own resource, then everything the request holds (the layer's too).
    let own = fenced(&app.pool, &lock).await;
    assert_eq!(own, StatusCode::OK);
    assert_eq!(lock.tokens().len(), 1);
    fenced(&app.pool, &leases).await
}

async fn stored(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT resource, token FROM redlock_fences ORDER BY resource")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn layer_lease_locked_and_request_leases_fence_what_they_hold() {
    let db = TestDatabase::create().await;
    let pool = db.pool(4).await;
    fence::postgres::FenceTable::default()
        .create(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    let locker = Redlock::in_memory();
    let app = App {
        locker: locker.clone(),
        pool: pool.clone(),
    };
    let router = Router::new()
        .route("/orders/{id}", post(with_layer_lease))
        .route("/orders/{id}/move", post(with_locked))
        .route_layer(LockLayer::new(locker.clone(), path_param("id")).scope(Scope::shared("order")))
        .with_state(app);

    let call = |path: &str| {
        Request::post(path)
            .header("x-account", "acct-1")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let response = router.clone().oneshot(call("/orders/42")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let token: u64 = response.headers()["fencing-token"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(stored(&pool).await, [("order:42".to_owned(), token as i64)]);

    let response = router
        .clone()
        .oneshot(call("/orders/42/move"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let rows = stored(&pool).await;
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0].0, "account:acct-1");
    assert_eq!(rows[1].0, "order:42");
    assert!(
        rows[1].1 > token as i64,
        "the later lease advanced the order's fence"
    );

    // A lease older than what the fence holds: refused.
    let stale = (Resource::from("order:42"), FencingToken::new(token));
    assert_eq!(fenced(&pool, &stale).await, StatusCode::CONFLICT);
}
