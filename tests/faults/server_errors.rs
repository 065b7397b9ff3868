//! Scenario 9: Redis answering with errors.

use super::*;

// ---------------------------------------------------------------------------------------
// 9. Redis answering with errors
// ---------------------------------------------------------------------------------------

fn lpush(server: &RedisServer, key: &str) {
    let reply = server.cmd(&["LPUSH", key, "x"]);
    assert_eq!(reply.as_int(), Some(1), "LPUSH {key}: {reply:?}");
}

/// Wrong types at the fence key and at the lock key, and a full server (`maxmemory
/// 1mb`, `noeviction`): every attempt ends in a clear error that names the server's
/// complaint, nothing panics, and nothing is left held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s09_server_errors() {
    let _serial = SERIAL.lock().await;
    let ttl = ms(800);
    let options = LockOptions::default().ttl(ttl);
    let history = History::new("s09_server_errors");
    let mut notes: Vec<(String, String)> = Vec::new();

    // (a) A list at the fence key on every node: the acquire script's SET lands, then
    // INCR fails with WRONGTYPE. The attempt fails with the server's error and the keys
    // that did land are released.
    let servers = RedisServer::start_many(3);
    let locker = Redlock::connect(urls(&servers), options.clone())
        .await
        .expect("locker");
    for s in &servers {
        lpush(s, &fence_of("wrongfence"));
    }
    for attempt in 0..n(20) {
        let err = if attempt % 2 == 0 {
            answered(|| locker.try_acquire("wrongfence")).await
        } else {
            answered(|| locker.acquire("wrongfence", Duration::from_secs(1))).await
        }
        .expect_err("a wrong-type fence key on every node cannot give a lease");
        let text = err.to_string();
        assert!(
            matches!(err, LockError::Unavailable { .. }) && text.contains("WRONGTYPE"),
            "fence key of the wrong type: {text}"
        );
        history.unavailable();
        if attempt == 0 {
            notes.push(("wrong_fence_error".into(), text));
        }
    }
    assert_nothing_held(&servers, std::slice::from_ref(&locker), ttl / 2).await;

    // ... on one node only: the other two still give a lease; the bad node's key (ours,
    // the SET landed before the error) goes with the release.
    lpush(&servers[0], &fence_of("onebad"));
    for _ in 0..n(20) {
        let lease = acquire_patiently(&locker, "onebad", bound(10)).await;
        let mut section = history.begin("onebad", lease.fencing_token().get(), "one bad node");
        section.write();
        section.end(lease.lost_cause().is_some());
        lease.release().await;
    }
    assert_nothing_held(&servers, std::slice::from_ref(&locker), ttl / 2).await;

    // (b) A list at the lock key: `SET NX` finds the key taken, and reading its holder
    // hits WRONGTYPE. Both the single attempt and the waiting one fail at once with the
    // server's error; the foreign key is left alone.
    for s in &servers {
        lpush(s, &key_of("wronglock"));
    }
    for attempt in 0..n(10) {
        let err = if attempt % 2 == 0 {
            answered(|| locker.try_acquire("wronglock")).await
        } else {
            answered(|| locker.acquire("wronglock", Duration::from_secs(1))).await
        }
        .expect_err("a foreign key at the lock key cannot give a lease");
        let text = err.to_string();
        assert!(
            matches!(err, LockError::Unavailable { .. }) && text.contains("WRONGTYPE"),
            "lock key of the wrong type: {text}"
        );
        history.unavailable();
        if attempt == 0 {
            notes.push(("wrong_lock_error".into(), text));
        }
    }
    for s in &servers {
        assert_eq!(s.cmd(&["LLEN", &key_of("wronglock")]).as_int(), Some(1));
        s.cmd(&["DEL", &key_of("wronglock")]);
    }
    // Free again once the foreign key is gone.
    acquire_patiently(&locker, "wronglock", bound(10))
        .await
        .release()
        .await;

    // (b2) The lock key replaced by a list while held: renewals and the release hit
    // WRONGTYPE inside the scripts. The lease is lost, the release unconfirmed, no panic.
    let lease = acquire_patiently(&locker, "replaced", bound(10)).await;
    let mut section = history.begin("replaced", lease.fencing_token().get(), "replaced holder");
    // In one step on each server: the acquisition's last node may still be setting the
    // key in the background (the round was won by the others), and a SET landing
    // between a DEL and an LPUSH would leave a string there.
    for s in &servers {
        let reply = s.cmd(&[
            "EVAL",
            "redis.call('DEL', KEYS[1]); return redis.call('LPUSH', KEYS[1], 'x')",
            "1",
            &key_of("replaced"),
        ]);
        assert_eq!(reply.as_int(), Some(1), "replacing the key: {reply:?}");
    }
    let cause = tokio::time::timeout(bound(10), lease.lost())
        .await
        .expect("the lease must be reported lost");
    if lease.remaining() > ttl / 10 {
        section.write();
    }
    section.end(true);
    notes.push(("replaced_lost_cause".into(), format!("{cause:?}")));
    let outcome = lease.release().await;
    notes.push(("replaced_release".into(), format!("{outcome:?}")));
    assert!(
        !matches!(outcome, ReleaseOutcome::Released),
        "a key of the wrong type cannot be released as ours: {outcome:?}"
    );
    for s in &servers {
        assert_eq!(
            s.cmd(&["LLEN", &key_of("replaced")]).as_int(),
            Some(1),
            "the foreign key stays"
        );
        s.cmd(&["DEL", &key_of("replaced")]);
    }
    assert_nothing_held(&servers, std::slice::from_ref(&locker), ttl / 2).await;
    drop(servers);
    let first_locker = locker;

    // (c) Out of memory: maxmemory 1mb, noeviction, filled with one big value.
    let full: Vec<RedisServer> = (0..3)
        .map(|_| {
            RedisServer::builder()
                .arg("--maxmemory-policy", "noeviction")
                .start()
        })
        .collect();
    let locker = Redlock::connect(urls(&full), options.clone())
        .await
        .expect("locker");
    // Warm up (connections, scripts) while there is room, then set the limit: an idle
    // server uses ~0.9 MB, and its first connection and scripts reach 1 MB.
    acquire_patiently(&locker, "oom", bound(10))
        .await
        .release()
        .await;
    for s in &full {
        assert!(s.cmd(&["CONFIG", "SET", "maxmemory", "1mb"]).is_ok());
    }
    let filler = "x".repeat(2 * 1024 * 1024);
    for s in &full {
        // Accepted (the check runs before the command) or refused as already full.
        let _ = s.cmd(&["SET", "filler", &filler]);
        let probe = s.cmd(&["SET", "probe", "1"]);
        assert!(
            matches!(&probe, support::RespValue::Error(e) if e.starts_with("OOM")),
            "server not full: {probe:?}"
        );
    }
    for _ in 0..n(20) {
        let err = answered(|| locker.try_acquire("oom"))
            .await
            .expect_err("no room for a lock");
        let text = err.to_string();
        assert!(
            matches!(err, LockError::Unavailable { .. }) && text.contains("OOM"),
            "full server: {text}"
        );
        history.unavailable();
        if !notes.iter().any(|(k, _)| k == "oom_error") {
            notes.push(("oom_error".into(), text));
        }
    }
    assert_nothing_held(&full, std::slice::from_ref(&locker), ttl / 2).await;
    // Room again (the limit lifted): the same locker works.
    for s in &full {
        assert!(s.cmd(&["CONFIG", "SET", "maxmemory", "0"]).is_ok());
    }
    let lease = acquire_patiently(&locker, "oom", bound(10)).await;
    lease.release().await;
    assert_nothing_held(&full, std::slice::from_ref(&locker), ttl / 2).await;

    let summary = report(finish(&history, &[first_locker, locker]));
    for (k, v) in notes {
        println!("[faults]   {k}: {v}");
    }
    assert_eq!(summary.violations, 0);
}
