//! The built-in key extractors on request heads and bodies, by their public API.

use http::request::Parts;
use http::{Method, Request};
use tower_redlock::http::key::{header, json_field, query_param, webhook, Header, KeyExtractor};
use tower_redlock::http::problem::ProblemKind;

fn parts(uri: &str, headers: &[(&str, &[u8])]) -> Parts {
    let mut builder = Request::builder().method(Method::POST).uri(uri);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(()).unwrap().into_parts().0
}

#[test]
fn header_values() {
    let key = header("Idempotency-Key");
    assert_eq!(key.name(), "idempotency-key");
    assert_eq!(key.keys(&mut parts("/", &[]), &[]).unwrap(), None);
    assert_eq!(
        key.keys(&mut parts("/", &[("idempotency-key", b"k1")]), &[])
            .unwrap()
            .as_deref(),
        Some("k1")
    );
    let twice = key
        .keys(
            &mut parts("/", &[("idempotency-key", b"a"), ("idempotency-key", b"b")]),
            &[],
        )
        .unwrap_err();
    assert_eq!(twice.kind(), ProblemKind::KeyInvalid);
    // Bytes that are not UTF-8 are refused, never folded into U+FFFD (two values
    // would then name one lock); UTF-8 is a key like any other.
    let odd = key
        .keys(&mut parts("/", &[("idempotency-key", b"a\xffb")]), &[])
        .unwrap_err();
    assert_eq!(odd.kind(), ProblemKind::KeyInvalid);
    assert_eq!(
        key.keys(&mut parts("/", &[("idempotency-key", "é".as_bytes())]), &[])
            .unwrap()
            .as_deref(),
        Some("é")
    );
}

#[test]
fn idempotency_keys_are_structured_field_strings() {
    let key = header("Idempotency-Key");
    let get = |value: &str| {
        key.keys(
            &mut parts("/", &[("idempotency-key", value.as_bytes())]),
            &[],
        )
    };
    assert_eq!(
        get(r#""8e03978e-40d5""#).unwrap().as_deref(),
        Some("8e03978e-40d5")
    );
    assert_eq!(
        get("8e03978e-40d5").unwrap().as_deref(),
        Some("8e03978e-40d5")
    );
    assert_eq!(
        get(r#""a \"b\" \\c""#).unwrap().as_deref(),
        Some(r#"a "b" \c"#)
    );
    assert_eq!(get(r#""""#).unwrap().as_deref(), Some(""));
    for bad in [r#"""#, r#""abc"#, r#""a"b"#, r#""a\b""#, r#""a\""#, "\"é\""] {
        assert_eq!(
            get(bad).unwrap_err().kind(),
            ProblemKind::KeyInvalid,
            "{bad}"
        );
    }
    // Other headers are taken as they are, unless asked.
    let other = |h: Header| {
        h.keys(&mut parts("/", &[("x-key", br#""k""#)]), &[])
            .unwrap()
            .unwrap()
    };
    assert_eq!(other(header("x-key")), r#""k""#);
    assert_eq!(other(header("x-key").sf_string(true)), "k");
    assert_eq!(
        header("Idempotency-Key")
            .sf_string(false)
            .keys(&mut parts("/", &[("idempotency-key", br#""k""#)]), &[])
            .unwrap()
            .as_deref(),
        Some(r#""k""#)
    );
}

#[test]
#[should_panic(expected = "invalid header name")]
fn bad_header_names_panic() {
    let _ = header("not a header");
}

#[test]
fn query_params() {
    let key = query_param("key");
    let get = |uri: &str| key.keys(&mut parts(uri, &[]), &[]);
    assert_eq!(get("/").unwrap(), None);
    assert_eq!(get("/?other=1").unwrap(), None);
    assert_eq!(get("/?a=1&key=x%2Fy&b").unwrap().as_deref(), Some("x/y"));
    assert_eq!(get("/?k%65y=v").unwrap().as_deref(), Some("v"));
    assert_eq!(get("/?key").unwrap().as_deref(), Some(""));
    assert_eq!(get("/?key=a+b").unwrap().as_deref(), Some("a b"));
    assert_eq!(get("/?key=100%").unwrap().as_deref(), Some("100%"));
    assert_eq!(
        get("/?key=1&key=2").unwrap_err().kind(),
        ProblemKind::KeyInvalid
    );
    assert_eq!(
        get("/?key=%FF").unwrap_err().kind(),
        ProblemKind::KeyInvalid
    );
}

#[test]
fn tuples_join_without_collisions() {
    let pair = (header("a"), header("b"));
    let key = |a: &str, b: &str| {
        pair.keys(
            &mut parts("/", &[("a", a.as_bytes()), ("b", b.as_bytes())]),
            &[],
        )
        .unwrap()
        .unwrap()
    };
    assert_ne!(key("ab", "c"), key("a", "bc"));
    assert_ne!(key("a:b", "c"), key("a", "b:c"));
    assert_eq!(key("ab", "c"), "ab:c");
    assert_eq!(
        pair.keys(&mut parts("/", &[("a", b"x")]), &[]).unwrap(),
        None
    );
    let empty = pair
        .keys(&mut parts("/", &[("a", b""), ("b", b"x")]), &[])
        .unwrap_err();
    assert_eq!(empty.kind(), ProblemKind::KeyInvalid);

    let triple = (header("a"), header("b"), query_param("c"));
    assert_eq!(
        triple
            .keys(&mut parts("/?c=3", &[("a", b"1"), ("b", b"2")]), &[])
            .unwrap()
            .as_deref(),
        Some("1:2:3")
    );
    assert_eq!(
        triple.describe(),
        "the `a` header and the `b` header and the `c` query parameter"
    );
}

#[test]
fn closures_and_fallbacks() {
    let method = |parts: &Parts| Some(parts.method.to_string());
    assert_eq!(
        method.keys(&mut parts("/", &[]), &[]).unwrap().as_deref(),
        Some("POST")
    );
    let shopify = webhook::shopify();
    let get = |headers: &[(&str, &[u8])]| shopify.keys(&mut parts("/", headers), &[]).unwrap();
    assert_eq!(get(&[]), None);
    assert_eq!(get(&[("x-shopify-webhook-id", b"w")]).as_deref(), Some("w"));
    assert_eq!(
        get(&[("x-shopify-webhook-id", b"w"), ("x-shopify-event-id", b"e")]).as_deref(),
        Some("e")
    );
    assert_eq!(
        webhook::github()
            .keys(&mut parts("/", &[("X-GitHub-Delivery", b"d")]), &[])
            .unwrap()
            .as_deref(),
        Some("d")
    );
}

#[test]
#[should_panic(expected = "JSON Pointer")]
fn bad_pointers_panic() {
    let _ = json_field("id");
}
