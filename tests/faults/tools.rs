//! The tools themselves: the checker must be able to fail, the proxy must do what it
//! says.

use super::*;

// ---------------------------------------------------------------------------------------
// The tools themselves: the checker must be able to fail, the proxy must do what it says
// ---------------------------------------------------------------------------------------

#[test]
#[should_panic(expected = "overlapping critical sections, both writes accepted")]
fn tool_checker_fails_on_overlapping_accepted_writes() {
    let history = History::new("tool_overlap");
    let mut a = history.begin("r", 1, "a");
    let mut b = history.begin("r", 2, "b");
    assert!(a.write());
    assert!(b.write());
    b.end(false);
    a.end(false);
    history.check();
}

#[test]
fn tool_checker_accepts_overlap_saved_by_fencing() {
    let history = History::new("tool_fenced");
    let mut a = history.begin("r", 1, "a (paused)");
    let mut b = history.begin("r", 2, "b");
    assert!(b.write());
    assert!(!a.write(), "the stale write must be rejected");
    a.end(true);
    b.end(false);
    let summary = history.check();
    assert_eq!(summary.rejected_stale_writes, 1);
    assert_eq!(summary.lost_leases, 1);
    assert_eq!(summary.cycles, 2);
}

#[test]
#[should_panic(expected = "fencing order broken")]
fn tool_checker_fails_on_a_token_that_does_not_increase() {
    let history = History::new("tool_order");
    let mut a = history.begin("r", 7, "a");
    a.write();
    a.end(false);
    // A later holder with an older token: its write is refused, but the lock's own
    // fencing order is broken and the checker says so.
    let mut b = history.begin("r", 5, "b");
    b.write();
    b.end(false);
    history.check();
}

#[test]
#[should_panic(expected = "granted while a majority")]
fn tool_checker_fails_on_a_recorded_failure() {
    let history = History::new("tool_fail");
    history.fail("lease granted while a majority of the nodes was down");
    history.check();
}

#[test]
fn tool_checker_without_exclusion_counts_overlaps_but_checks_fencing() {
    let history = History::new("tool_no_exclusion").without_exclusion();
    let mut a = history.begin("r", 1, "a");
    let mut b = history.begin("r", 2, "b");
    assert!(a.write());
    assert!(b.write());
    b.end(false);
    a.end(false);
    let summary = history.check();
    assert!(summary
        .notes
        .contains(&("overlaps_accepted".to_owned(), "1".to_owned())));
    // Fencing is still claimed: a later holder with an older token fails the check.
    let mut c = history.begin("r", 2, "c");
    c.write();
    c.end(false);
    let order = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| history.check()))
        .expect_err("must fail");
    let text = order
        .downcast_ref::<String>()
        .map_or("", String::as_str)
        .to_owned();
    assert!(text.contains("fencing order broken"), "{text}");
}

#[test]
fn tool_checker_ends_an_abandoned_section_on_drop() {
    let history = History::new("tool_drop");
    let mut a = history.begin("r", 1, "aborted");
    a.write();
    drop(a);
    let mut b = history.begin("r", 2, "next");
    b.write();
    b.end(false);
    assert_eq!(history.check().cycles, 2);
}

/// A raw client of the proxy: blocking, with a read timeout, reading one reply at a time.
fn raw_client(addr: std::net::SocketAddr) -> std::io::BufReader<std::net::TcpStream> {
    let stream = std::net::TcpStream::connect(addr).expect("connect to the proxy");
    stream
        .set_read_timeout(Some(ms(300)))
        .expect("read timeout");
    std::io::BufReader::new(stream)
}

fn try_send(
    client: &mut std::io::BufReader<std::net::TcpStream>,
    args: &[&str],
) -> std::io::Result<()> {
    use std::io::Write;
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    client
        .get_mut()
        .write_all(&support::resp::encode_command(&args))
}

fn send(client: &mut std::io::BufReader<std::net::TcpStream>, args: &[&str]) {
    try_send(client, args).expect("write");
}

fn reply(
    client: &mut std::io::BufReader<std::net::TcpStream>,
) -> std::io::Result<support::RespValue> {
    support::resp::read_value(client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_proxy_latency_blackhole_reset_and_cut() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr());
    let addr = proxy.addr();
    let handle = proxy.clone();
    blocking(move || {
        // Plain forwarding.
        let mut client = raw_client(addr);
        send(&mut client, &["PING"]);
        assert_eq!(reply(&mut client).unwrap().as_str(), Some("PONG"));

        // Latency: at least the configured delay each way (a lower bound cannot flake).
        handle.set_latency(Latency::Fixed(ms(40)));
        let start = Instant::now();
        send(&mut client, &["PING"]);
        assert_eq!(reply(&mut client).unwrap().as_str(), Some("PONG"));
        assert!(start.elapsed() >= ms(80));
        handle.set_latency(Latency::None);

        // Blackhole: nothing comes back, also not on a new connection; after the heal
        // the held request is answered on the same connection.
        handle.blackhole();
        send(&mut client, &["SET", "k", "held"]);
        assert!(reply(&mut client).is_err(), "no reply through a blackhole");
        let mut during = raw_client(addr);
        send(&mut during, &["PING"]);
        assert!(reply(&mut during).is_err(), "a new connection is held too");
        assert_eq!(
            server.get("k"),
            None,
            "the held request did not reach the server"
        );
        handle.heal();
        client
            .get_ref()
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        during
            .get_ref()
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        assert!(reply(&mut client).unwrap().is_ok());
        assert_eq!(reply(&mut during).unwrap().as_str(), Some("PONG"));
        assert_eq!(server.get("k").as_deref(), Some("held"));

        // Reset: current connections die, new ones work.
        handle.reset_connections();
        let dead = try_send(&mut client, &["PING"]).and_then(|()| reply(&mut client));
        assert!(dead.is_err(), "a reset connection cannot answer: {dead:?}");
        let mut fresh = raw_client(addr);
        send(&mut fresh, &["PING"]);
        assert_eq!(reply(&mut fresh).unwrap().as_str(), Some("PONG"));

        // Cut: part of the next reply, then the connection closes.
        server.set("big", &"v".repeat(10_000));
        handle.cut_next_reply();
        send(&mut fresh, &["GET", "big"]);
        let cut = reply(&mut fresh);
        assert!(cut.is_err(), "a cut reply cannot be parsed: {cut:?}");
        assert_eq!(handle.cuts_done(), 1);
        let mut after = raw_client(addr);
        send(&mut after, &["STRLEN", "big"]);
        assert_eq!(reply(&mut after).unwrap().as_int(), Some(10_000));
    });
    assert_eq!(proxy.connections_accepted(), 4);

    // Dropping the last handle (the clone went with the closure) stops the proxy: the
    // port refuses connections.
    drop(proxy);
    support::eventually("the proxy stops listening", Duration::from_secs(5), || {
        std::net::TcpStream::connect(addr).is_err()
    })
    .await;
}
