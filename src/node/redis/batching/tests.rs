use redis::AsyncConnectionConfig;

use super::*;

fn batching() -> Batching {
    let client = redis::Client::open("redis://127.0.0.1:1/0").unwrap();
    Batching::new(Resending::new(client, AsyncConnectionConfig::new()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_under_the_multi_thread_runtime() {
    assert!(batching().node.batched);
}

#[tokio::test(flavor = "current_thread")]
async fn sends_as_it_comes_under_the_current_thread_runtime() {
    assert!(!batching().node.batched);
}

/// A command sent alone counts as in flight until it answers or is dropped (a count
/// left behind would hold every later leader back a scheduler pass), and a caller
/// that comes meanwhile leads a batch instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_sent_alone_counts_in_flight_until_dropped() {
    // A listener that accepts and never answers: every send stays pending.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}/0", listener.local_addr().unwrap());
    let client = redis::Client::open(url).unwrap();
    let (mut first_conn, mut second_conn) = {
        let batching = Batching::new(Resending::new(client, AsyncConnectionConfig::new()));
        (batching.clone(), batching)
    };
    let node = first_conn.node.clone();
    let in_flight = || node.in_flight.load(Ordering::Acquire);
    let batch_open = || lock(&node.open).is_some();
    let mut cx = Context::from_waker(Waker::noop());
    let get = redis::cmd("GET");

    let mut first = Box::pin(first_conn.send_one(&get));
    assert!(first.as_mut().poll(&mut cx).is_pending());
    assert_eq!((in_flight(), batch_open()), (1, false), "sent alone");

    let mut second = Box::pin(second_conn.send_one(&get));
    assert!(second.as_mut().poll(&mut cx).is_pending());
    assert_eq!(
        (in_flight(), batch_open()),
        (1, true),
        "leads a batch, yielding"
    );

    drop(first);
    assert_eq!(in_flight(), 0, "the dropped command no longer counts");
    drop(second);
    assert_eq!((in_flight(), batch_open()), (0, false));
}
