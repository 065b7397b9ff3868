//! The orders example, tested: `examples/orders/main.rs` is included as a module (by
//! `main.rs`), so these tests drive the very router the demo serves, with `oneshot`,
//! against three real `redis-server`s (and in memory).
//!
//! No sleeps sequence anything and nothing asserts on timing: concurrent requests are
//! spawned together and only their outcomes are checked.
use crate::support;

use crate::orders_example as orders;

use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use orders::{Config, Entry, Ledger};
use serde_json::Value;
use support::RedisServer;
use tokio::task::JoinSet;
use tower::ServiceExt;
use tower_redlock::{http::problem::ProblemKind, FencingToken, Redlock};

/// Bound on one response; only reached when a test fails.
const RESPONSE_LIMIT: Duration = Duration::from_secs(60);

/// The demo's configuration over `servers`; waits are long so that a slow, shared
/// machine cannot turn a queued shipment into a timeout.
fn config(servers: &[RedisServer]) -> Config {
    Config {
        redis_urls: servers.iter().map(RedisServer::url).collect(),
        wait_timeout: RESPONSE_LIMIT,
        node_timeout: Some(support::PATIENT_NODE_TIMEOUT),
        ..Config::default()
    }
}

struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    json: Value,
}

impl Answer {
    /// Checks the RFC 9457 envelope and returns the problem's code (the `type` fragment).
    fn problem_code(&self) -> String {
        assert_eq!(
            self.headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
            Some("application/problem+json"),
            "{}: {}",
            self.status,
            self.json
        );
        assert_eq!(self.json["status"], self.status.as_u16());
        assert!(self.json["title"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(self.json["detail"].as_str().is_some_and(|d| !d.is_empty()));
        let type_uri = self.json["type"].as_str().expect("type");
        type_uri.rsplit_once('#').expect("type#code").1.to_owned()
    }

    fn token(&self) -> u64 {
        self.json["fencing_token"]
            .as_str()
            .expect("fencing_token is a decimal string")
            .parse()
            .unwrap()
    }
}

/// The customer every request with an idempotency key comes from.
const CUSTOMER: &str = "c1";

async fn send(app: &Router, method: &str, uri: &str, key: Option<&str>) -> Answer {
    let mut request = Request::builder().method(method).uri(uri);
    if let Some(key) = key {
        // `/payments`' keys are the customer's.
        request = request
            .header("Idempotency-Key", key)
            .header("Authorization", format!("Bearer {CUSTOMER}"));
    }
    let request = request.body(Body::empty()).unwrap();
    let response = tokio::time::timeout(RESPONSE_LIMIT, app.clone().oneshot(request))
        .await
        .expect("no response")
        .unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let json = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    Answer {
        status: parts.status,
        headers: parts.headers,
        json,
    }
}

/// Sends `n` requests at once, spread round-robin over `apps` (one per instance).
async fn concurrently(apps: &[Router], n: usize, method: &str, uri: &str) -> Vec<Answer> {
    let mut set = JoinSet::new();
    for i in 0..n {
        let app = apps[i % apps.len()].clone();
        let (method, uri) = (method.to_owned(), uri.to_owned());
        set.spawn(async move { send(&app, &method, &uri, None).await });
    }
    let mut answers = Vec::with_capacity(n);
    while let Some(answer) = set.join_next().await {
        answers.push(answer.unwrap());
    }
    answers
}

/// The successful answers sorted by their entry number (`payment` or `shipment`):
/// the numbers are 1..=k and the fencing tokens increase with them.
fn check_sequence(answers: &[Answer], order: &str, field: &str) -> Vec<u64> {
    let mut done: Vec<(u64, u64)> = answers
        .iter()
        .filter(|a| a.status == StatusCode::OK)
        .map(|a| {
            assert_eq!(a.json["order"], order);
            (a.json[field].as_u64().expect(field), a.token())
        })
        .collect();
    done.sort_unstable();
    let numbers: Vec<u64> = done.iter().map(|&(n, _)| n).collect();
    assert_eq!(numbers, (1..=done.len() as u64).collect::<Vec<_>>());
    let tokens: Vec<u64> = done.iter().map(|&(_, t)| t).collect();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens must increase with the {field} number: {tokens:?}"
    );
    tokens
}

async fn status_of(app: &Router, order: &str) -> Value {
    let answer = send(app, "GET", &format!("/orders/{order}"), None).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.json);
    assert_eq!(answer.json["order"], order);
    answer.json
}

/// 20 payments of one order at once: some succeed, the others are refused with 409
/// `lock-held`; never do two run together, and the tokens increase.
async fn concurrent_pays(apps: &[Router], order: &str) -> Vec<u64> {
    let answers = concurrently(apps, 20, "POST", &format!("/orders/{order}/pay?work_ms=50")).await;
    for answer in &answers {
        match answer.status {
            StatusCode::OK => {}
            StatusCode::CONFLICT => {
                assert_eq!(answer.problem_code(), "lock-held");
                assert_eq!(answer.json["resource"], format!("order:{order}"));
                assert!(answer.headers.contains_key(http::header::RETRY_AFTER));
            }
            other => panic!("unexpected {other}: {}", answer.json),
        }
    }
    let tokens = check_sequence(&answers, order, "payment");
    assert!(!tokens.is_empty(), "at least the first payment succeeds");
    let status = status_of(&apps[0], order).await;
    assert_eq!(status["payments"], tokens.len());
    assert_eq!(status["max_in_flight"], 1, "{status}");
    assert_eq!(
        status["last_fencing_token"],
        tokens.last().unwrap().to_string()
    );
    tokens
}

/// 10 shipments of one order at once: they wait their turn, so all succeed, one at a time.
async fn concurrent_ships(apps: &[Router], order: &str) -> Vec<u64> {
    let answers = concurrently(
        apps,
        10,
        "POST",
        &format!("/orders/{order}/ship?work_ms=20"),
    )
    .await;
    for answer in &answers {
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.json);
    }
    let tokens = check_sequence(&answers, order, "shipment");
    assert_eq!(tokens.len(), 10);
    let status = status_of(&apps[0], order).await;
    assert_eq!(status["shipments"], 10);
    assert_eq!(status["max_in_flight"], 1, "{status}");
    tokens
}

// ------------------------------------------------------------------------------------
// over three redis-servers

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_concurrent_pays_never_overlap_and_tokens_increase() {
    let servers = RedisServer::start_many(3);
    let app = orders::build(&config(&servers)).unwrap();
    let tokens = concurrent_pays(std::slice::from_ref(&app), "42").await;

    // The ledger lives in the first node only.
    assert!(servers[0].exists("orders-example:ledger:42"));
    assert!(servers[1].keys("orders-example:*").is_empty());
    assert!(servers[2].keys("orders-example:*").is_empty());

    // The next payment, alone, succeeds with a larger token once the last lease's
    // release (in the background, after the response) has landed.
    let next = std::sync::Mutex::new(None);
    support::eventually_async("the order's lock is free again", RESPONSE_LIMIT, || {
        let (app, next) = (app.clone(), &next);
        async move {
            let answer = send(&app, "POST", "/orders/42/pay?work_ms=0", None).await;
            let done = answer.status == StatusCode::OK;
            if !done {
                assert_eq!(answer.problem_code(), "lock-held");
            }
            *next.lock().unwrap() = Some(answer);
            done
        }
    })
    .await;
    let next = next.into_inner().unwrap().unwrap();
    assert_eq!(next.json["payment"], tokens.len() + 1);
    assert!(next.token() > *tokens.last().unwrap());
    assert_eq!(
        next.headers["fencing-token"].to_str().unwrap(),
        next.token().to_string(),
        "the JSON token is the layer's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_two_instances_share_locks_and_ledger() {
    let servers = RedisServer::start_many(3);
    // Two instances of the service: two lockers, two ledger connections, one Redis.
    let instances = [
        orders::build(&config(&servers)).unwrap(),
        orders::build(&config(&servers)).unwrap(),
    ];
    concurrent_pays(&instances, "7").await;
    let ship_tokens = concurrent_ships(&instances, "8").await;
    assert_eq!(
        status_of(&instances[1], "8").await["last_fencing_token"],
        ship_tokens.last().unwrap().to_string()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_pay_and_ship_of_one_order_share_the_lock() {
    let servers = RedisServer::start_many(3);
    let instances = [
        orders::build(&config(&servers)).unwrap(),
        orders::build(&config(&servers)).unwrap(),
    ];
    let mut set = JoinSet::new();
    for i in 0..16 {
        let app = instances[i % 2].clone();
        let uri = if i % 2 == 0 {
            "/orders/9/ship?work_ms=20"
        } else {
            "/orders/9/pay?work_ms=20"
        };
        set.spawn(async move { send(&app, "POST", uri, None).await });
    }
    let mut answers = Vec::new();
    while let Some(answer) = set.join_next().await {
        answers.push(answer.unwrap());
    }
    let (ships, pays): (Vec<Answer>, Vec<Answer>) = answers
        .into_iter()
        .partition(|a| a.status != StatusCode::OK || a.json.get("shipment").is_some());
    let ships: Vec<Answer> = ships
        .into_iter()
        .filter(|a| {
            if a.status == StatusCode::CONFLICT {
                // Only payments are refused; shipments wait.
                assert_eq!(a.problem_code(), "lock-held");
                false
            } else {
                true
            }
        })
        .collect();
    assert_eq!(ships.len(), 8, "every shipment succeeds");
    check_sequence(&ships, "9", "shipment");
    check_sequence(&pays, "9", "payment");
    let mut tokens: Vec<u64> = ships.iter().chain(&pays).map(Answer::token).collect();
    let count = tokens.len();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), count, "every holder has its own token");
    let status = status_of(&instances[0], "9").await;
    assert_eq!(status["max_in_flight"], 1, "{status}");
    assert_eq!(status["shipments"], 8);
    assert_eq!(status["payments"], pays.len());
    assert_eq!(
        status["last_fencing_token"],
        tokens.last().unwrap().to_string()
    );
}

/// A writer with a newer token than any lease of `locker` records a payment of order 5
/// first: the ledger refuses an older token (and counts it out of the in-flight count),
/// and the route's next payment gets 409 `stale-fencing-token`. Returns the newer token
/// and that answer.
async fn a_newer_writer_fences_out_the_order(
    ledger: &Ledger,
    locker: &Redlock,
    app: &Router,
    first: u64,
) -> (u64, Answer) {
    let newer = first + (1 << 40);
    let visit = ledger.enter("5").await.unwrap();
    let recorded = visit.record(Entry::Payment, FencingToken::new(newer)).await;
    assert_eq!(recorded.unwrap(), 2);
    let visit = ledger.enter("5").await.unwrap();
    assert!(matches!(
        visit.record(Entry::Payment, FencingToken::new(first)).await,
        Err(orders::LedgerError::Stale { last, .. }) if last == newer
    ));
    support::eventually("the first lease is released", RESPONSE_LIMIT, || {
        locker.local_resources() == 0
    })
    .await;
    let stale = send(app, "POST", "/orders/5/pay?work_ms=0", None).await;
    assert_eq!(stale.status, StatusCode::CONFLICT, "{}", stale.json);
    assert_eq!(stale.problem_code(), "stale-fencing-token");
    (newer, stale)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stale_fencing_token_is_refused_with_409() {
    let servers = RedisServer::start_many(3);
    let config = config(&servers);
    let locker = Redlock::connect(&config.redis_urls, support::patient())
        .await
        .unwrap();
    let ledger = Ledger::redis(&config.redis_urls[0]).unwrap();
    let app = orders::app(locker.clone(), ledger.clone(), &config);

    let first = send(&app, "POST", "/orders/5/pay?work_ms=0", None).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.json);

    let (newer, stale) =
        a_newer_writer_fences_out_the_order(&ledger, &locker, &app, first.token()).await;
    assert_eq!(stale.json["last_fencing_token"], newer.to_string());
    assert!(
        stale.json["fencing_token"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            < newer
    );

    let status = status_of(&app, "5").await;
    assert_eq!(status["payments"], 2);
    assert_eq!(status["last_fencing_token"], newer.to_string());
    assert_eq!(status["max_in_flight"], 1);
    let record = ledger.order("5").await.unwrap();
    assert_eq!(record.in_flight, 0, "every visit left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_payments_need_an_idempotency_key() {
    let servers = RedisServer::start_many(3);
    let app = orders::build(&config(&servers)).unwrap();

    let missing = send(&app, "POST", "/payments", None).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.problem_code(), ProblemKind::KeyMissing.code());

    let created = send(&app, "POST", "/payments?work_ms=0", Some("pay-1")).await;
    assert_eq!(created.status, StatusCode::OK, "{}", created.json);
    assert_eq!(created.json["idempotency_key"], "pay-1");
    assert!(created.token() > 0);
    assert_eq!(
        created.headers["fencing-token"].to_str().unwrap(),
        created.token().to_string()
    );
}

// ------------------------------------------------------------------------------------
// in memory, and the routes' details

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_mode_works_the_same() {
    let app = orders::build(&Config {
        wait_timeout: RESPONSE_LIMIT,
        ..Config::default()
    })
    .unwrap();
    assert_eq!(
        send(&app, "GET", "/healthz", None).await.status,
        StatusCode::OK
    );
    let pay_tokens = concurrent_pays(std::slice::from_ref(&app), "1").await;
    let ship_tokens = concurrent_ships(std::slice::from_ref(&app), "1").await;
    assert!(
        ship_tokens[0] > *pay_tokens.last().unwrap(),
        "one lock, one token sequence"
    );
    let missing = send(&app, "POST", "/payments", None).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.problem_code(), "key-missing");
}

#[tokio::test]
async fn unknown_orders_and_bad_work_ms() {
    let app = orders::build(&Config::default()).unwrap();
    let status = status_of(&app, "nope").await;
    assert_eq!(status["payments"], 0);
    assert_eq!(status["shipments"], 0);
    assert_eq!(status["max_in_flight"], 0);
    assert_eq!(status["last_fencing_token"], Value::Null);

    for uri in [
        "/orders/3/pay?work_ms=60001",
        "/orders/3/ship?work_ms=abc",
        "/payments?work_ms=-1",
    ] {
        let answer = send(&app, "POST", uri, Some("k")).await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{uri}: {}",
            answer.json
        );
        assert_eq!(answer.problem_code(), "invalid-work-ms");
    }
    // Refused before entering the ledger.
    assert_eq!(status_of(&app, "3").await["max_in_flight"], 0);
}

// ------------------------------------------------------------------------------------
// the README's promise: any one lock node may fail (issue 19, item 7)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_with_its_own_ledger_server_any_one_lock_node_may_fail() {
    let mut servers = RedisServer::start_many(3);
    let ledger = RedisServer::start();
    let app = orders::build(&Config {
        ledger_url: Some(ledger.url()),
        ..config(&servers)
    })
    .unwrap();
    // The first node, where the ledger used to live, is the one that fails.
    servers[0].kill();
    let paid = send(&app, "POST", "/orders/7/pay?work_ms=0", None).await;
    assert_eq!(paid.status, StatusCode::OK, "{}", paid.json);
    assert_eq!(paid.json["payment"], 1);
    let status = status_of(&app, "7").await;
    assert_eq!(status["payments"], 1, "{status}");
    // The ledger is in its own server.
    assert!(ledger.exists("orders-example:ledger:7"));
}

#[tokio::test]
async fn the_payment_names_the_key_the_layer_locked() {
    let app = orders::build(&Config::default()).unwrap();
    // The structured form of the IETF draft: the quotes are not part of the key.
    let created = send(&app, "POST", "/payments?work_ms=0", Some(r#""8e03978e""#)).await;
    assert_eq!(created.status, StatusCode::OK, "{}", created.json);
    assert_eq!(created.json["idempotency_key"], "8e03978e");
    let bare = send(&app, "POST", "/payments?work_ms=0", Some("8e03978e")).await;
    assert_eq!(bare.json, created.json, "the same payment, replayed");
    assert_eq!(bare.headers["idempotent-replayed"], "true");
}

/// With `DATABASE_URL` (feature `postgres`) the ledger lives in PostgreSQL and every
/// write is fenced: the payment counted with its token, a writer with an older token
/// refused by the database (409 `stale-fencing-token` from the route, nothing counted).
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_ledger_fences_every_write() {
    let db = support::postgres::TestDatabase::create().await;
    let config = Config {
        database_url: Some(db.url().to_owned()),
        wait_timeout: RESPONSE_LIMIT,
        ..Config::default()
    };
    let (locker, ledger) = orders::locker_and_ledger(&config).unwrap();
    let app = orders::app(locker.clone(), ledger.clone(), &config);

    let first = send(&app, "POST", "/orders/5/pay?work_ms=0", None).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.json);
    let status = send(&app, "GET", "/orders/5", None).await;
    assert_eq!(status.json["payments"], 1);
    assert_eq!(status.json["last_fencing_token"], first.token().to_string());

    let (newer, _) =
        a_newer_writer_fences_out_the_order(&ledger, &locker, &app, first.token()).await;
    let status = send(&app, "GET", "/orders/5", None).await;
    assert_eq!(status.json["payments"], 2);
    assert_eq!(status.json["max_in_flight"], 1);
    assert_eq!(status.json["last_fencing_token"], newer.to_string());
}

/// `DATABASE_URL` alone runs the whole demo on PostgreSQL, over real sockets and no
/// Redis: the lock is a row of `redlock_leases` in that database, and `/payments` writes
/// its charge through the request's transaction (`Tx`), committed with its record. The
/// first attempt writes, then loses its lock mid-way (its lease row deleted, as a paused
/// or partitioned process's expires) and commits nothing; the retry runs at once (no
/// `outcome-unknown`, no reconciliation) and charges once; the next retry is replayed.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_alone_payments_commit_with_their_record_and_a_cut_attempt_leaves_nothing() {
    use crate::http_client::{Req, Served};

    let db = support::postgres::TestDatabase::create().await;
    let config = Config {
        database_url: Some(db.url().to_owned()),
        lock_ttl: Duration::from_secs(1),
        ..Config::default()
    };
    let (locker, ledger) = orders::locker_and_ledger(&config).unwrap();
    ledger.prepare().await.unwrap();
    let served = Served::start(orders::app(locker, ledger.clone(), &config)).await;
    let pay = |work_ms: u32| {
        Req::post(format!("/payments?work_ms={work_ms}"))
            .header("Idempotency-Key", "i1")
            .header("Authorization", &format!("Bearer {CUSTOMER}"))
    };
    let pool = db.pool(1).await;
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    let first = {
        let request = pay(60_000);
        let addr = served.addr;
        tokio::spawn(async move {
            crate::http_client::Conn::open(addr)
                .await
                .send(request)
                .await
        })
    };
    // The first attempt holds its lock in the database and took its transaction, open
    // while its handler works.
    support::eventually_async("the first attempt takes Tx", RESPONSE_LIMIT, || async {
        count(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND state = 'idle in transaction'",
        )
        .await
            == 1
    })
    .await;
    assert_eq!(count("SELECT count(*) FROM redlock_leases").await, 1);
    // It loses its lock, as a paused or partitioned process would.
    sqlx::query("DELETE FROM redlock_leases")
        .execute(&pool)
        .await
        .unwrap();
    let cut = first.await.unwrap();
    assert_eq!(cut.status, 503, "{}", cut.text());
    assert_eq!(ledger.order("payment:c1:i1").await.unwrap().payments, 0);

    // The retry runs at once, and charges once.
    let answer = served.send(pay(0)).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    let json: Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(json["payment"], 1);
    let replayed = served.send(pay(0)).await;
    assert_eq!(replayed.body, answer.body);
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        ledger.order("payment:c1:i1").await.unwrap().payments,
        1,
        "charged once"
    );
    assert_eq!(count("SELECT count(*) FROM redlock_leases").await, 0);
}
