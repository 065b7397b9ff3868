//! Scenarios 7 and 8c, at the HTTP level (feature `axum`): duplicate requests through
//! two `LockLayer` routers while nodes fail, and clients that go away mid-request.

use super::*;

// ---------------------------------------------------------------------------------------
// 7. Duplicate HTTP requests through two LockLayer routers while nodes fail
// ---------------------------------------------------------------------------------------

/// Two app instances (two `Redlock`s, two axum routers behind `LockLayer`) on the same
/// three nodes; 16 clients send duplicate requests — a few order ids, both instances,
/// a rejecting route and a waiting route that share the lock of an order
/// (`Scope::shared`) — while node 0 is killed and restarted empty, node 1 is frozen
/// longer than the ttl, and finally a majority is down. Handlers record their critical
/// section and write to the fenced storage with the token of the layer's lease.
///
/// Every answer must be a 200 carrying the handler's token in `Fencing-Token`, or a
/// problem+json refusal this route may give (409 `lock-held` / `lock-wait-timeout`, 503
/// `lock-unavailable` / `lock-lost` / `lock-queue-full`); no request may outlive the
/// wait timeout plus the ttl (plus slack); no 200 while a majority is down. Two witness
/// requests inside their handler when the majority goes down must end as their
/// `OnLost` policy says: 503 `lock-lost` (abort), 200 marked `LeaseLost` (continue).
///
/// `BROKEN=1` gives each route its own lock (`Scope::Route`): paying and shipping one
/// order then overlap, and the checker fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s07_http_duplicate_requests_under_faults() {
    use tower_redlock::http::OnLost;
    use web::{AppSpec, Route};
    let _serial = SERIAL.lock().await;
    if broken() {
        eprintln!("BROKEN=1: each route locks its own resource (Scope::Route), although both change the order");
    }
    let mut servers = RedisServer::start_many(3);
    let ttl = ms(800);
    let wait = ms(500);
    let options = LockOptions::default().ttl(ttl);
    let lockers = lockers(2, &urls(&servers), &options);
    let history = History::new("s07_http_duplicate_requests_under_faults");
    let specs = [
        AppSpec {
            name: "A",
            on_lost: OnLost::Abort,
            ship_queue_limit: None,
        },
        AppSpec {
            name: "B",
            on_lost: OnLost::Continue,
            ship_queue_limit: Some(2),
        },
    ];
    let (witness_tx, mut witness_rx) = tokio::sync::mpsc::unbounded_channel();
    let apps: Vec<(AppSpec, axum::Router)> = specs
        .iter()
        .zip(&lockers)
        .map(|(spec, locker)| {
            let app = web::order_app(*spec, locker, wait, &history, &witness_tx);
            (*spec, app)
        })
        .collect();
    // Hang guard: a waiting request answers by its wait timeout, a handler is stopped
    // or done within the ttl of losing its lease; the rest is slack for a loaded machine.
    let limit = wait + ttl * 2 + Duration::from_secs(5);
    let outage = Arc::new(AtomicBool::new(false));
    let clients = web::Clients::spawn(&apps, 16, 8, limit, &outage, &history);
    let tally = clients.tally.clone();
    let step = n(200);
    // Each phase: `answers` more answers, among them 20 more critical sections.
    let advance = |answers: u64, name: &'static str| {
        web::phase(&tally, &history, answers, n(20), bound(30), name)
    };

    advance(step, "healthy").await;
    blocking(|| servers[0].kill());
    advance(step, "node 0 down").await;
    blocking(|| servers[0].restart());
    advance(step, "node 0 back, empty").await;
    blocking(|| servers[1].pause());
    let paused_at = Instant::now();
    advance(step / 2, "node 1 paused").await;
    // The fault outlasts the ttl: every key node 1 holds expires meanwhile.
    tokio::time::sleep_until(paused_at + ttl * 3 / 2).await;
    blocking(|| servers[1].resume());
    advance(step, "node 1 resumed").await;

    // Witnesses inside their handlers (one per instance and policy), then a majority
    // goes down: node 0 killed, node 2 frozen.
    let witness_a =
        web::enter_witness(&apps[0].1, "w-abort", Route::Pay, &mut witness_rx, limit).await;
    let witness_b = web::enter_witness(
        &apps[1].1,
        "w-continue",
        Route::Ship,
        &mut witness_rx,
        limit,
    )
    .await;
    blocking(|| {
        servers[0].kill();
        servers[2].pause();
    });
    outage.store(true, Ordering::SeqCst);
    let outage_at = Instant::now();
    let unavailable_before = tally.unavailable.load(Ordering::Relaxed);
    let wanted = n(100);
    support::eventually(
        "503 lock-unavailable answers while a majority is down",
        bound(30),
        || tally.unavailable.load(Ordering::Relaxed) >= unavailable_before + wanted,
    )
    .await;
    let witness_a = witness_a.await.expect("witness A").unwrap_or_else(|| {
        panic!("witness A (OnLost::Abort) still inside {limit:?} after the majority went down")
    });
    let witness_b = witness_b.await.expect("witness B").unwrap_or_else(|| {
        panic!("witness B (OnLost::Continue) still inside {limit:?} after the majority went down")
    });
    outage.store(false, Ordering::SeqCst);
    let in_outage = tally.unavailable.load(Ordering::Relaxed) - unavailable_before;
    if verbose() {
        println!(
            "[faults]   phase `majority down`: {in_outage} answers 503 lock-unavailable, witnesses out, in {:.2}s",
            outage_at.elapsed().as_secs_f64()
        );
    }
    blocking(|| {
        servers[2].resume();
        servers[0].restart();
    });
    advance(step, "majority back").await;
    let tally = clients.stop().await;

    assert_nothing_held(&servers, &lockers, ttl * 2).await;
    for (kind, count) in tally.kinds() {
        println!("[faults]   {kind}: {count}");
    }
    // The checker first: with BROKEN=1 it is the one that must fail.
    let summary = finish(&history, &lockers);
    let witness_causes = format!("{:?}/{:?}", witness_a.lease_lost(), witness_b.lease_lost());
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let requests = tally.responses();
    let summary = report(
        summary
            .note("requests", requests)
            .note("ok", get(&tally.ok))
            .note("409_held", tally.count("409 lock-held"))
            .note("409_wait_timeout", tally.count("409 lock-wait-timeout"))
            .note("503_unavailable", get(&tally.unavailable))
            .note("503_unavailable_in_outage", in_outage)
            .note("503_queue_full", tally.count("503 lock-queue-full"))
            .note("503_lost", tally.count("503 lock-lost"))
            .note("200_after_loss", get(&tally.ok_after_loss))
            .note("hung", get(&tally.hung))
            .note("slowest_ms", tally.slowest().as_millis())
            .note("limit_ms", limit.as_millis())
            .note("witness_lost", witness_causes),
    );
    assert!(requests >= n(1000), "only {requests} requests");
    assert_eq!(get(&tally.hung), 0);
    assert!(get(&tally.ok) > 0 && summary.cycles > 0);
    assert!(tally.count("409 lock-held") > 0, "duplicates must collide");
    assert!(in_outage >= wanted);
    // The witnesses: A was stopped by the layer (503 lock-lost), B finished and its
    // 200 is marked; neither wrote (no validity left).
    assert_eq!(
        (witness_a.parts.status, witness_a.problem_code()),
        (http::StatusCode::SERVICE_UNAVAILABLE, Ok("lock-lost")),
        "witness A (OnLost::Abort): {}",
        witness_a.text()
    );
    assert!(witness_a.lease_lost().is_some(), "witness A: no LeaseLost");
    assert_eq!(
        witness_b.parts.status,
        http::StatusCode::OK,
        "witness B (OnLost::Continue): {}",
        witness_b.text()
    );
    assert!(
        witness_b.token().is_ok(),
        "witness B: {:?}",
        witness_b.token()
    );
    assert!(
        witness_b.lease_lost().is_some(),
        "witness B: 200 not marked LeaseLost"
    );
    assert!(summary.skipped_writes >= 1);
}

/// The HTTP part of scenario 8: clients that go away mid-request, over real TCP.
/// Two app instances are served by `axum::serve` on 127.0.0.1; a raw HTTP/1.1 client
/// sends `POST /jobs` and, while the handler runs (it never finishes by itself), closes
/// its socket (FIN), or resets it (RST), or — waiting for the lock behind another
/// client's request on the other instance — closes it before getting in.
///
/// hyper's HTTP/1 server keeps reading the connection while the handler runs (with
/// `half_close` off, axum's default) and drops the request's future on EOF or error:
/// the handler future and the lease go with it. Every time the handler must be
/// dropped, and the lock key gone from every node, within 10 s of the disconnect
/// (ttl 30 s: a bound far above a loaded machine's delays, far below expiry; the node
/// timeout is generous too); a waiter that went away must leave no queue entry and
/// must not disturb the holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s08c_http_client_disconnect_releases_promptly() {
    let _serial = SERIAL.lock().await;
    let servers = RedisServer::start_many(3);
    let ttl = Duration::from_secs(30);
    let options = support::patient().ttl(ttl);
    let lockers = lockers(2, &urls(&servers), &options);
    let history = History::new("s08c_http_client_disconnect_releases_promptly");
    let limit = Duration::from_secs(10);
    assert!(limit < ttl / 2);
    let (entered_tx, mut entered_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut addrs = Vec::new();
    let mut server_tasks = Vec::new();
    for (name, locker) in ["A", "B"].into_iter().zip(&lockers) {
        let app = web::job_app(name, locker, bound(30), &history, &entered_tx);
        let (addr, task) = web::serve(app).await;
        addrs.push(addr);
        server_tasks.push(task);
    }

    // The handler of a request is inside: its key is on the nodes.
    let check_inside = |entered: &web::Entered, what: &str| {
        let holding = web::holding(&servers, &entered.resource, &entered.owner);
        assert!(holding >= 2, "{what}: the key is on {holding} nodes only");
    };
    // After a disconnect: the handler future is dropped, then the key leaves every node.
    async fn released(
        entered: web::Entered,
        servers: &[RedisServer],
        gone_at: Instant,
        limit: Duration,
        what: &str,
    ) -> Duration {
        match tokio::time::timeout(limit, entered.dropped).await {
            Ok(Err(_)) => {}
            Ok(Ok(())) => unreachable!("the guard never sends"),
            Err(_) => panic!(
                "{what}: the handler of app {} still runs {limit:?} after the client went away",
                entered.app
            ),
        }
        let left = limit.saturating_sub(gone_at.elapsed());
        support::eventually(
            &format!("{what}: the lock key leaves every node"),
            left,
            || web::holding(servers, &entered.resource, &entered.owner) == 0,
        )
        .await;
        gone_at.elapsed()
    }

    let rounds = n(150);
    let mut counts = [0u64; 3];
    let mut slowest = Duration::ZERO;
    for round in 0..rounds {
        let variant = usize::try_from(round % 3).unwrap_or(0);
        let a = usize::try_from(round / 3 % 2).unwrap_or(0);
        let key = format!("job-{}", round % 5);
        let what = format!("round {round} ({})", ["FIN", "RST", "waiter FIN"][variant]);
        let (holder, entered) = web::enter_job(addrs[a], "/jobs", &key, &mut entered_rx).await;
        check_inside(&entered, &what);
        let took = match variant {
            // The client closes its socket while the handler runs.
            0 => {
                drop(holder);
                released(entered, &servers, Instant::now(), limit, &what).await
            }
            // The client's connection is reset while the handler runs.
            1 => {
                holder.set_zero_linger().expect("SO_LINGER 0");
                drop(holder);
                released(entered, &servers, Instant::now(), limit, &what).await
            }
            // A second client waits for the lock on the other instance, then gives up.
            _ => {
                let b = 1 - a;
                let waiter = web::open_request(addrs[b], "/jobs/wait", &key).await;
                support::eventually(&format!("{what}: the waiter queues"), bound(10), || {
                    lockers[b].local_resources() == 1
                })
                .await;
                drop(waiter);
                support::eventually(
                    &format!("{what}: the waiter leaves the queue"),
                    limit,
                    || lockers[b].local_resources() == 0,
                )
                .await;
                assert!(
                    entered_rx.try_recv().is_err(),
                    "{what}: the waiter's handler ran"
                );
                let holding = web::holding(&servers, &entered.resource, &entered.owner);
                assert!(
                    holding >= 2,
                    "{what}: the waiter disturbed the holder ({holding} nodes)"
                );
                drop(holder);
                released(entered, &servers, Instant::now(), limit, &what).await
            }
        };
        counts[variant] += 1;
        slowest = slowest.max(took);
        // Nothing left locally either (the next round may lock the same key).
        support::eventually(&format!("{what}: no local holder or waiter"), limit, || {
            lockers.iter().all(|l| l.local_resources() == 0)
        })
        .await;
    }

    assert_nothing_held(&servers, &lockers, limit).await;
    for task in server_tasks {
        task.abort();
    }
    let summary = report(
        finish(&history, &lockers)
            .note("fin", counts[0])
            .note("rst", counts[1])
            .note("waiter_fin", counts[2])
            .note("slowest_release_ms", slowest.as_millis()),
    );
    assert_eq!(summary.cycles, rounds);
}

/// 8d. One execution per key through real HTTP: clients that hang up at random points
/// of their requests and retry with the same key, on either of two instances, while a
/// lock node is restarted (AOF, fsync always: it comes back with its keys). Idempotent
/// replay, `OnDisconnect::Finish` (the default), `Contention::Reject`. The checker
/// counts each key's side effects — charges made by the handler — and requires exactly
/// one per key, and every client to end with the first charge's response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s08d_clients_that_hang_up_and_retry_are_charged_once() {
    use crate::http_client::{Conn, Req, Served};
    use axum::Extension;
    use rand::Rng;
    use std::collections::HashMap;
    use tower_redlock::http::{key::header, replay::Replay, LockLayer, RequestKey};

    let _serial = SERIAL.lock().await;
    let mut servers: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::builder().appendonly(true).start())
        .collect();
    let options = support::patient().ttl(Duration::from_secs(5));
    let lockers = lockers(2, &urls(&servers), &options);
    // The side effect: charges per key, over both instances.
    let charges: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let mut instances = Vec::new();
    for locker in &lockers {
        let charges = charges.clone();
        let app = axum::Router::new()
            .route(
                "/charges",
                axum::routing::post(move |Extension(key): Extension<RequestKey>| {
                    let charges = charges.clone();
                    async move {
                        // Charge first, then the slow part, as a payment handler does.
                        let charge = {
                            let mut charges = charges.lock().unwrap_or_else(|p| p.into_inner());
                            let count = charges.entry(key.as_str().to_owned()).or_insert(0);
                            *count += 1;
                            *count
                        };
                        let work = rand::rng().random_range(0..30);
                        tokio::time::sleep(Duration::from_millis(work)).await;
                        (
                            axum::http::StatusCode::CREATED,
                            format!("charge {charge} of {}", key.as_str()),
                        )
                    }
                }),
            )
            .route_layer(
                LockLayer::new(locker.clone(), header("Idempotency-Key")).replay(Replay::global()),
            );
        instances.push(Served::start(app).await);
    }
    let addrs: Vec<_> = instances.iter().map(|s| s.addr).collect();

    let keys = n(60);
    let clients = (0..keys).map(|i| {
        let addrs = addrs.clone();
        tokio::spawn(async move {
            let key = format!("pay-{i}");
            let request = Req::post("/charges").header("idempotency-key", &key);
            let (mut hangups, mut refusals) = (0u32, 0u32);
            for attempt in 0.. {
                assert!(attempt < 2000, "{key}: no answer after {attempt} attempts");
                let (addr, hang_up) = {
                    let mut rng = rand::rng();
                    let addr = addrs[rng.random_range(0..addrs.len())];
                    // Half the attempts hang up after a random moment.
                    let hang_up = rng.random_bool(0.5).then(|| rng.random_range(0..20));
                    (addr, hang_up)
                };
                let mut conn = Conn::open(addr).await;
                conn.write(&request).await;
                if let Some(after) = hang_up {
                    tokio::time::sleep(Duration::from_millis(after)).await;
                    drop(conn);
                    hangups += 1;
                    continue;
                }
                let reply = conn.read_reply().await;
                match reply.status {
                    201 => return (key, reply.text(), hangups, refusals),
                    // In progress, held, a node restarting: retry.
                    409 | 503 => {
                        refusals += 1;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    other => panic!("{key}: unexpected {other}: {}", reply.text()),
                }
            }
            unreachable!()
        })
    });
    let clients: Vec<_> = clients.collect();

    // Meanwhile one node restarts, with its keys.
    let victim = &mut servers[1];
    tokio::task::block_in_place(|| victim.restart());
    let done_at_restart = clients.iter().filter(|c| c.is_finished()).count();

    let mut answers = Vec::new();
    for client in clients {
        answers.push(
            tokio::time::timeout(bound(120), client)
                .await
                .expect("a client hung")
                .unwrap(),
        );
    }
    let charges = charges.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let (mut hangups, mut refusals) = (0, 0);
    for (key, body, hung, refused) in &answers {
        assert_eq!(
            charges.get(key),
            Some(&1),
            "{key}: charged {:?} times",
            charges.get(key)
        );
        assert_eq!(
            body,
            &format!("charge 1 of {key}"),
            "{key}: the answer is the first charge's"
        );
        hangups += hung;
        refusals += refused;
    }
    assert_eq!(charges.len() as u64, keys);
    println!(
        "[faults] s08d: {keys} keys, each charged once; {hangups} hang-ups, {refusals} refusals retried; one node restarted with {done_at_restart} keys done"
    );
    drop(instances);
    // Every lock released (the records stay, for their retention).
    support::eventually("every lock key is gone", bound(30), || {
        answers.iter().all(|(key, ..)| {
            let lock = format!(
                "redlock:{{{}}}",
                Resource::new("POST").join("/charges").join(key)
            );
            servers.iter().all(|server| !server.exists(&lock))
        }) && lockers.iter().all(|l| l.local_resources() == 0)
    })
    .await;
}
