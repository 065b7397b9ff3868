//! Node URLs through the public API: how `split_node_urls` cuts a list, which node
//! `node_from_url` builds for each scheme (with its feature only), and what it says of
//! a URL it refuses.

use tower_redlock::{node_from_url, split_node_urls};

#[test]
fn node_url_lists_split_where_a_new_url_starts() {
    let split = |s: &str| split_node_urls(s);
    assert!(split("").is_empty());
    assert!(split(" , \n").is_empty());
    assert_eq!(
        split("redis://a:1,redis://b:2 , redis://c:3"),
        ["redis://a:1", "redis://b:2", "redis://c:3"]
    );
    assert_eq!(
        split("redis+cluster://:pw@127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003/"),
        ["redis+cluster://:pw@127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003/"]
    );
    assert_eq!(
        split("\tredis://a:1\nrediss+sentinel://s:1,s:2/m/1?wait_replicas=1 redis+cluster://k:1"),
        [
            "redis://a:1",
            "rediss+sentinel://s:1,s:2/m/1?wait_replicas=1",
            "redis+cluster://k:1",
        ]
    );
    assert_eq!(
        split("etcd://127.0.0.1:2379,127.0.0.1:22379,127.0.0.1:32379/locks"),
        ["etcd://127.0.0.1:2379,127.0.0.1:22379,127.0.0.1:32379/locks"]
    );
    // Not a URL: kept apart, so that `node_from_url` says what is wrong.
    assert_eq!(split("a:1,redis://b:2"), ["a:1", "redis://b:2"]);
    assert_eq!(split("://x,1redis://y"), ["://x,1redis://y"]);
}

#[test]
fn etcd_urls_build_an_etcd_node_with_the_feature_only() {
    let built = node_from_url("etcd://127.0.0.1:2379,127.0.0.1:22379/app");
    if cfg!(feature = "etcd") {
        let node = built.unwrap();
        assert_eq!(node.name(), "etcd://127.0.0.1:2379,127.0.0.1:22379/app/");
    } else {
        let err = built.map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("`etcd` feature"), "{err}");
    }
}

#[tokio::test]
async fn cluster_and_sentinel_urls_build_with_their_feature_only() {
    for (url, feature, on) in [
        (
            "redis+cluster://127.0.0.1:7001,127.0.0.1:7002",
            "cluster",
            cfg!(feature = "cluster"),
        ),
        (
            "redis+sentinel://127.0.0.1:26379/m",
            "sentinel",
            cfg!(feature = "sentinel"),
        ),
    ] {
        let built = node_from_url(url);
        if on {
            assert!(built.is_ok(), "{url}");
        } else {
            let err = built.map(|_| ()).unwrap_err().to_string();
            assert!(err.contains(&format!("`{feature}` feature")), "{err}");
        }
    }
}

#[cfg(all(feature = "cluster", feature = "sentinel"))]
#[tokio::test]
async fn builds_every_kind_and_rejects_nonsense() {
    for (url, name) in [
        ("redis://127.0.0.1:7001/2", "redis://127.0.0.1:7001/2"),
        ("redis://:pw@127.0.0.1:7001", "redis://127.0.0.1:7001/0"),
        (
            "redis://user:pw@127.0.0.1:7001/0?wait_replicas=1&wait_timeout_ms=5",
            "redis://127.0.0.1:7001/0",
        ),
        (
            "redis://127.0.0.1:7001/0?tcp_nodelay=false&protocol=resp3",
            "redis://127.0.0.1:7001/0",
        ),
        (
            "redis+cluster://user:pw@127.0.0.1:7001,127.0.0.1:7002/",
            "redis+cluster://127.0.0.1:7001,127.0.0.1:7002",
        ),
        (
            "redis+cluster://127.0.0.1:7001/?tcp_nodelay=false",
            "redis+cluster://127.0.0.1:7001",
        ),
        (
            "redis+sentinel://127.0.0.1,127.0.0.1:26380/mymaster/3?sentinel_password=x",
            "redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/mymaster",
        ),
    ] {
        let node = node_from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(node.name(), name);
    }
    for (url, says) in [
        ("127.0.0.1:6379", "scheme"),
        ("http://127.0.0.1", "unknown URL scheme"),
        ("redis://a:1,b:2", "redis+cluster"),
        ("redis+cluster:///", "host"),
        ("redis+sentinel://127.0.0.1:26379", "master's name"),
        ("redis+sentinel://127.0.0.1:26379/m/x", "database"),
        ("redis+sentinel://127.0.0.1:26379/m/1/2", "path"),
        ("redis://127.0.0.1?wait_replicas=many", "wait_replicas"),
        ("redis://127.0.0.1?tcp_nodelay=no", "true or false"),
        (
            "redis+sentinel://127.0.0.1:26379/m?tcp_nodelay=true",
            "not redis+sentinel://",
        ),
        (
            "redis+unix:///run/redis.sock?tcp_nodelay=false",
            "not redis+unix://",
        ),
        ("redis://127.0.0.1:notaport", "bad Redis URL"),
    ] {
        let err = node_from_url(url).map(|_| ()).expect_err(url).to_string();
        assert!(err.contains(says), "{url}: {err}");
    }
    let err = node_from_url("redis://user:topsecret@127.0.0.1:notaport")
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(!err.contains("topsecret"), "{err}");
}
