//! Key checks and body keys (the head extractors are tested in `tests/http/keys.rs`).

use super::*;
use crate::http::problem::ProblemKind;
use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;

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
    // Unknown size: refused while reading; several chunks within the limit are joined.
    #[cfg(feature = "axum")]
    {
        let streamed = |chunks: &'static [&'static str]| {
            let chunks = chunks
                .iter()
                .map(|c| Ok::<_, std::convert::Infallible>(Bytes::from(*c)));
            Request::new(axum::body::Body::from_stream(futures_util::stream::iter(
                chunks,
            )))
        };
        let request = streamed(&["{\"id\"", ":\"1234", "56\"}"]);
        let err = <Bytes as Read<_>>::read(request, 8).await.unwrap_err();
        assert_eq!(err.kind(), ProblemKind::BodyTooLarge);
        let request = streamed(&["{\"id\"", ":1}"]);
        let (_, bytes) = <Bytes as Read<_>>::read(request, 64).await.unwrap();
        assert_eq!(bytes, "{\"id\":1}");
    }
}
