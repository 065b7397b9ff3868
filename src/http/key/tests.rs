//! The built-in extractors.

use super::*;
use crate::http::problem::ProblemKind;
use bytes::Bytes;
use http::Method;
use http::Request;
use http_body_util::BodyExt;

fn parts(uri: &str, headers: &[(&str, &[u8])]) -> Parts {
    let mut builder = Request::builder().method(Method::POST).uri(uri);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(()).unwrap().into_parts().0
}

#[test]
fn validation() {
    assert!(validate("abc-123_~!", 255).is_ok());
    assert!(validate("", 255).is_err());
    assert!(validate(&"a".repeat(255), 255).is_ok());
    assert!(validate(&"a".repeat(256), 255).is_err());
    for good in ["a b", "é", "\u{fffd}", "日本", "\"quoted\""] {
        assert!(validate(good, 255).is_ok(), "{good:?}");
    }
    for bad in ["a\tb", "a\nb", "\0", "a\u{7f}", "a\u{85}"] {
        assert!(validate(bad, 255).is_err(), "{bad:?}");
    }
    // The limit counts bytes, not characters.
    assert!(validate(&"é".repeat(128), 255).is_err());
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

#[tokio::test]
async fn json_fields() {
    let field = &json_field("/data/id");
    // Read as the layer reads it: the handler gets the same bytes.
    let extract = |body: &'static str| async move {
        let request = Request::new(http_body_util::Full::new(Bytes::from(body)));
        let (request, bytes) = <Bytes as Read<_>>::read(request, DEFAULT_BODY_LIMIT).await?;
        let (mut parts, body) = request.into_parts();
        let key = field.keys(&mut parts, &bytes)?;
        Ok::<_, KeyRejection>((Request::from_parts(parts, body), key))
    };
    let (request, key) = extract(r#"{"data":{"id":"evt_1"}}"#).await.unwrap();
    assert_eq!(key.as_deref(), Some("evt_1"));
    let body = request.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, r#"{"data":{"id":"evt_1"}}"#);
    assert_eq!(
        extract(r#"{"data":{"id":42}}"#).await.unwrap().1.as_deref(),
        Some("42")
    );
    assert_eq!(
        extract(r#"{"data":{"id":-1.5}}"#)
            .await
            .unwrap()
            .1
            .as_deref(),
        Some("-1.5")
    );
    assert_eq!(extract(r#"{"data":{"id":null}}"#).await.unwrap().1, None);
    assert_eq!(extract(r#"{"data":{}}"#).await.unwrap().1, None);
    assert_eq!(extract(r#"[1]"#).await.unwrap().1, None);
    assert_eq!(
        extract(r#"{"data":{"id":true}}"#).await.unwrap_err().kind(),
        ProblemKind::KeyInvalid
    );
    assert_eq!(
        extract("id=1").await.unwrap_err().kind(),
        ProblemKind::BodyNotJson
    );
    assert_eq!(
        extract("").await.unwrap_err().kind(),
        ProblemKind::BodyNotJson
    );
}

#[tokio::test]
async fn json_bodies_over_the_limit() {
    let field = json_field("/id").limit(8);
    // Known size: refused before reading.
    let request = Request::new(http_body_util::Full::new(Bytes::from(r#"{"id":"123456"}"#)));
    let err = <Bytes as Read<_>>::read(request, field.body_limit().unwrap())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ProblemKind::BodyTooLarge);
    // Read for a wider limit (another key's, replay's): refused by its own.
    let (mut parts, ()) = Request::new(()).into_parts();
    let err = field.keys(&mut parts, br#"{"id":"123456"}"#).unwrap_err();
    assert_eq!(err.kind(), ProblemKind::BodyTooLarge);
    // Unknown size: refused while reading.
    let chunks = futures_util::stream::iter(
        ["{\"id\"", ":\"1234", "56\"}"]
            .map(|c| Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from(c)))),
    );
    let request = Request::new(http_body_util::StreamBody::new(chunks));
    let (parts, body) = request.into_parts();
    let err = read_limited(body, 8).await.unwrap_err();
    assert_eq!(err.kind(), ProblemKind::BodyTooLarge);
    drop(parts);
    // Several chunks within the limit are joined.
    let chunks = futures_util::stream::iter(
        ["{\"id\"", ":1}"]
            .map(|c| Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from(c)))),
    );
    let bytes = read_limited(http_body_util::StreamBody::new(chunks), 64)
        .await
        .unwrap();
    assert_eq!(bytes, "{\"id\":1}");
}

#[test]
#[should_panic(expected = "JSON Pointer")]
fn bad_pointers_panic() {
    let _ = json_field("id");
}
