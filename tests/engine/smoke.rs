//! A first end-to-end check of the engine on three real redis-server nodes.
use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::RedisServer;
use tower_redlock::{FencingToken, LockError, LockOptions, Redlock, ReleaseOutcome};

fn locker(servers: &[RedisServer], options: LockOptions) -> Redlock {
    Redlock::from_urls(servers.iter().map(|s| s.url()), options).unwrap()
}

/// Takes `resource` `turns` times, checking through `inside` that no other holder is
/// in at the same time; the fencing tokens it got, in order.
async fn take_turns(
    locker: &Redlock,
    resource: &str,
    turns: usize,
    inside: &AtomicUsize,
) -> Vec<FencingToken> {
    let mut tokens = Vec::new();
    for _ in 0..turns {
        let lease = locker
            .acquire(resource, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "overlap");
        tokio::task::yield_now().await;
        inside.fetch_sub(1, Ordering::SeqCst);
        tokens.push(lease.fencing_token());
        lease.release().await;
    }
    tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_release_and_exclusion_on_three_nodes() {
    let servers = RedisServer::start_many(3);
    let locker = locker(&servers, LockOptions::default());
    let lease = locker.try_acquire("smoke").await.unwrap();
    // A majority holds our key when acquire returns; the third node may still be answering.
    let holding = servers
        .iter()
        .enumerate()
        .filter(|(i, s)| s.get("redlock:{smoke}").as_deref() == Some(lease.owner_on(*i).as_str()))
        .count();
    assert!(holding >= 2, "only {holding} nodes hold the key");
    let err = locker.try_acquire("smoke").await.unwrap_err();
    assert!(matches!(err, LockError::Held { .. }), "{err}");
    let other = locker.clone();
    let token = lease.fencing_token();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    let lease2 = other.try_acquire("smoke").await.unwrap();
    assert!(lease2.fencing_token() > token);
    drop(lease2);

    let inside = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let locker = locker.clone();
        let inside = inside.clone();
        tasks.push(tokio::spawn(async move {
            take_turns(&locker, "hot", 5, &inside).await
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(locker.local_resources(), 0);
}

/// With `tcp_nodelay=false` on every node (Nagle's algorithm: the kernel holds small
/// commands back and sends them together) the locks behave as with the default: 64
/// tasks at once on distinct keys all acquire and release, and on one key they take
/// turns, with tokens that only grow and are never handed out twice. (That the setting
/// reaches the connection is `standalone::tests::commands_go_out_at_once_unless_told_otherwise`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_nagle_the_locks_behave_as_before() {
    let servers = RedisServer::start_many(3);
    let locker = Redlock::from_urls(
        servers
            .iter()
            .map(|s| format!("{}?tcp_nodelay=false", s.url())),
        LockOptions::default(),
    )
    .unwrap();
    let inside = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..64)
        .map(|task| {
            let (locker, inside) = (locker.clone(), inside.clone());
            tokio::spawn(async move {
                for round in 0..20 {
                    let own = locker.try_acquire(format!("nagle:{task}:{round}")).await;
                    assert_eq!(own.unwrap().release().await, ReleaseOutcome::Released);
                }
                take_turns(&locker, "nagle:hot", 3, &inside).await
            })
        })
        .collect();
    let mut tokens = Vec::new();
    for task in tasks {
        let mine = task.await.unwrap();
        assert!(mine.windows(2).all(|w| w[0] < w[1]), "{mine:?}");
        tokens.extend(mine);
    }
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 64 * 3, "a token was handed out twice");
    assert_eq!(locker.local_resources(), 0);
}

/// The nodes' connections carry the setting to the kernel: `TCP_NODELAY` by default,
/// off with `tcp_nodelay=false`, read back from this process's sockets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nodes_sockets_carry_tcp_nodelay() {
    let servers = RedisServer::start_many(2);
    for (server, url, expected) in [
        (&servers[0], servers[0].url(), true),
        (
            &servers[1],
            format!("{}?tcp_nodelay=false", servers[1].url()),
            false,
        ),
    ] {
        let locker = Redlock::from_urls([url], LockOptions::default()).unwrap();
        locker.try_acquire("sockets").await.unwrap().release().await;
        let nodelay = support::sockets::nodelay_to(server.port());
        assert!(!nodelay.is_empty(), "no connection to {}", server.port());
        assert!(
            nodelay.iter().all(|&on| on == expected),
            "{nodelay:?}, expected {expected}"
        );
    }
}
