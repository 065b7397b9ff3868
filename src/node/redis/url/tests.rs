use super::*;

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
    for url in split("redis://a:1/0,redis+cluster://b:1,b:2/,redis+sentinel://c:1,c:2/m") {
        assert!(Url::parse(&url).is_ok(), "{url}");
    }
}

#[test]
fn splits_and_rebuilds() {
    let url = Url::parse("redis+cluster://u:p%40ss@h1:1,h2:2/0?protocol=resp3&wait_replicas=1#x")
        .unwrap();
    assert_eq!(url.scheme, "redis+cluster");
    assert_eq!(url.userinfo, Some("u:p%40ss"));
    assert_eq!(url.hosts, ["h1:1", "h2:2"]);
    assert_eq!(url.path, "/0");
    assert_eq!(url.fragment, Some("x"));
    assert_eq!(url.wait().unwrap(), Some((1, DEFAULT_WAIT_TIMEOUT)));
    let one = Url {
        scheme: "redis",
        ..url.clone()
    };
    assert_eq!(
        one.rebuild("h1:1", "/0"),
        "redis://u:p%40ss@h1:1/0?protocol=resp3#x"
    );
    let plain = Url::parse("redis://127.0.0.1").unwrap();
    assert_eq!(
        plain.rebuild(plain.hosts[0], plain.path),
        "redis://127.0.0.1"
    );
    assert_eq!(plain.wait().unwrap(), None);
    assert_eq!(plain.nodelay().unwrap(), None);
    let nagle = Url::parse("redis://h:1/0?tcp_nodelay=false&db=1").unwrap();
    assert_eq!(nagle.nodelay().unwrap(), Some(false));
    // Read here, not passed on to redis-rs.
    assert_eq!(nagle.rebuild("h:1", "/0"), "redis://h:1/0?db=1");
    let unix = Url::parse("redis+unix:///run/redis.sock?db=2").unwrap();
    assert_eq!(
        unix.rebuild("", unix.path),
        "redis+unix:///run/redis.sock?db=2"
    );
}

#[cfg(feature = "sentinel")]
#[test]
fn ports_and_decoding() {
    assert!(has_port("h:1"));
    assert!(!has_port("h"));
    assert!(has_port("[::1]:26379"));
    assert!(!has_port("[::1]"));
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
