// Replay takes one key per request: `json_fields` under `.replay()` is refused.
use axum::{routing::post, Router};
use tower_redlock::http::{key::json_fields, replay::Replay, LockLayer};
use tower_redlock::Redlock;

fn main() {
    let layer = LockLayer::new(Redlock::in_memory(), json_fields(["/from", "/to"])).replay(Replay::global());
    let _: Router = Router::new().route("/transfers", post(|| async {}).route_layer(layer));
}
