use super::*;

/// Every URL `split_node_urls` cuts out of a list parses on its own.
#[test]
fn split_urls_parse() {
    let split = |s: &str| crate::split_node_urls(s);
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
