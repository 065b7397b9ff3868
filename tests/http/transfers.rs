//! The orders demo's transfers (`examples/orders/transfers.rs`), driven through the very
//! router the demo serves: two instances (two lockers, two ledger connections) over
//! three real `redis-server`s, and in memory.
//!
//! Concurrent requests are spawned together and only their outcomes are checked: no
//! sleeps, no timing assertions.
use crate::support;

use crate::orders_example as orders;

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use orders::Config;
use serde_json::{json, Value};
use support::RedisServer;
use tokio::task::JoinSet;
use tower::ServiceExt;

/// Bound on one response; only reached when a test fails.
const RESPONSE_LIMIT: Duration = Duration::from_secs(60);

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
    headers: HeaderMap,
    json: Value,
}

async fn send(app: &Router, request: Request<Body>) -> Answer {
    let response = tokio::time::timeout(RESPONSE_LIMIT, app.clone().oneshot(request))
        .await
        .expect("no response")
        .unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    Answer {
        status: parts.status,
        headers: parts.headers,
        json,
    }
}

fn transfer(body: &str, query: &str) -> Request<Body> {
    Request::post(format!("/transfers{query}"))
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn account(app: &Router, id: &str) -> Value {
    let request = Request::get(format!("/accounts/{id}"))
        .body(Body::empty())
        .unwrap();
    let answer = send(app, request).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.json);
    assert_eq!(answer.json["account"], id);
    answer.json
}

/// `n` transfers at once between `accounts`, in both directions, spread over `apps`;
/// every one waits its turn and succeeds. Then the balances are the net of the 200s,
/// sum to zero, and no account ever had two transfers inside at once.
async fn transfers_in_both_directions(apps: &[Router], accounts: &[&str], n: usize) {
    let mut set = JoinSet::new();
    for i in 0..n {
        let from = accounts[i % accounts.len()];
        // Every other transfer goes the other way round the ring.
        let step = if i % 2 == 0 { 1 } else { accounts.len() - 1 };
        let to = accounts[(i + step) % accounts.len()];
        let amount = i as i64 + 1;
        let app = apps[i % apps.len()].clone();
        let body = json!({"from": from, "to": to, "amount": amount}).to_string();
        set.spawn(async move { send(&app, transfer(&body, "?work_ms=5")).await });
    }
    let mut net: HashMap<String, i64> = HashMap::new();
    let mut touched: HashMap<String, u64> = HashMap::new();
    let mut tokens: HashMap<String, Vec<u64>> = HashMap::new();
    while let Some(answer) = set.join_next().await {
        let answer = answer.unwrap();
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.json);
        let (from, to) = (
            answer.json["from"].as_str().unwrap().to_owned(),
            answer.json["to"].as_str().unwrap().to_owned(),
        );
        let amount = answer.json["amount"].as_i64().unwrap();
        *net.entry(from.clone()).or_default() -= amount;
        *net.entry(to.clone()).or_default() += amount;
        // Both tokens, by account, in the body and one header line per account.
        let lines: Vec<&str> = answer
            .headers
            .get_all("fencing-token")
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{lines:?}");
        for id in [&from, &to] {
            *touched.entry(id.clone()).or_default() += 1;
            let token: u64 = answer.json["fencing_tokens"][id]
                .as_str()
                .expect("a token per account")
                .parse()
                .unwrap();
            let line = format!("{token};resource=\"account:{id}\"");
            assert!(lines.contains(&line.as_str()), "{line} in {lines:?}");
            tokens.entry(id.clone()).or_default().push(token);
        }
    }
    let mut sum = 0;
    for id in accounts {
        for app in apps {
            let status = account(app, id).await;
            assert_eq!(status["balance"], net[*id], "{status}");
            assert_eq!(status["transfers"], touched[*id], "{status}");
            assert_eq!(status["max_in_flight"], 1, "{status}");
        }
        sum += net[*id];
        // Every write on an account carried a token of its own.
        let mut seen = tokens[*id].clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(
            seen.len(),
            tokens[*id].len(),
            "tokens of {id}: {:?}",
            tokens[*id]
        );
    }
    assert_eq!(sum, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_transfers_through_two_instances_balance_out() {
    let servers = RedisServer::start_many(3);
    let instances = [
        orders::build(&config(&servers)).unwrap(),
        orders::build(&config(&servers)).unwrap(),
    ];
    transfers_in_both_directions(&instances, &["a", "b", "c"], 24).await;
    // The balances live where the ledger lives: the first node.
    assert!(servers[0].exists("orders-example:account:a"));
    assert!(servers[1].keys("orders-example:*").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_transfers_balance_out() {
    let app = orders::build(&Config::default()).unwrap();
    transfers_in_both_directions(std::slice::from_ref(&app), &["a", "b", "c", "d"], 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_bad_transfers_are_refused_and_lock_nothing() {
    let servers = RedisServer::start_many(3);
    let app = orders::build(&config(&servers)).unwrap();
    let cases = [
        (
            r#"{"from":"a","to":"a","amount":5}"#,
            "",
            "invalid-transfer",
        ),
        (r#"{"to":"b","amount":5}"#, "", "invalid-transfer"),
        (r#"{"from":"a","amount":5}"#, "", "invalid-transfer"),
        (r#"{"from":"a","to":"b"}"#, "", "invalid-transfer"),
        (
            r#"{"from":"a","to":"b","amount":1.5}"#,
            "",
            "invalid-transfer",
        ),
        (
            r#"{"from":"a","to":"b","amount":"5"}"#,
            "",
            "invalid-transfer",
        ),
        (
            r#"{"from":"a","to":"b","amount":0}"#,
            "",
            "invalid-transfer",
        ),
        (r#"{"from":7,"to":"b","amount":5}"#, "", "invalid-transfer"),
        ("from=a&to=b", "", "invalid-transfer"),
        (
            r#"{"from":"a","to":"b","amount":5}"#,
            "?work_ms=soon",
            "invalid-work-ms",
        ),
    ];
    for (body, query, code) in cases {
        let answer = send(&app, transfer(body, query)).await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{body}: {}",
            answer.json
        );
        assert!(
            answer.json["type"]
                .as_str()
                .unwrap()
                .ends_with(&format!("#{code}")),
            "{body}: {}",
            answer.json
        );
        assert!(!answer.headers.contains_key("fencing-token"));
    }
    // Nothing was locked, nor even tried: no lock key and no fence counter anywhere.
    for server in &servers {
        assert!(
            server.keys("redlock:*").is_empty(),
            "{:?}",
            server.keys("*")
        );
    }
    for id in ["a", "b"] {
        let status = account(&app, id).await;
        assert_eq!(status["balance"], 0);
        assert_eq!(status["transfers"], 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_stale_account_token_is_refused() {
    let servers = RedisServer::start_many(3);
    let config = config(&servers);
    let locker = tower_redlock::Redlock::connect(&config.redis_urls, support::patient())
        .await
        .unwrap();
    let ledger = orders::Ledger::redis(&config.redis_urls[0]).unwrap();
    let app = orders::app(locker.clone(), ledger.clone(), &config);
    let first = send(
        &app,
        transfer(r#"{"from":"a","to":"b","amount":3}"#, "?work_ms=0"),
    )
    .await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.json);
    let token_of_a: u64 = first.json["fencing_tokens"]["a"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();

    // A writer with a newer token for `a` got there first.
    let accounts = orders::Accounts::beside(&ledger);
    let newer = token_of_a + (1 << 40);
    let mut visit = accounts.enter(&["a"]).await.unwrap();
    let balance = visit
        .write("a", -1, tower_redlock::FencingToken::new(newer))
        .await
        .unwrap();
    assert_eq!(balance, -4);
    drop(visit);

    // The lease of the first transfer is released in the background after its response.
    support::eventually("the first lease is released", RESPONSE_LIMIT, || {
        locker.local_resources() == 0
    })
    .await;
    let stale = send(
        &app,
        transfer(r#"{"from":"a","to":"b","amount":3}"#, "?work_ms=0"),
    )
    .await;
    assert_eq!(stale.status, StatusCode::CONFLICT, "{}", stale.json);
    assert!(stale.json["type"]
        .as_str()
        .unwrap()
        .ends_with("#stale-fencing-token"));
    assert_eq!(stale.json["last_fencing_token"], newer.to_string());
    // Refused writes leave the in-flight counts; the balance is the newer writer's.
    let status = account(&app, "a").await;
    assert_eq!(status["balance"], -4, "{status}");
    assert_eq!(status["max_in_flight"], 1, "{status}");
}
