// `Locked` takes the locker from the state: a state without `Redlock: FromRef<S>` is
// named by `#[debug_handler]` (the error is axum's `FromRef`).
use std::time::Duration;

use tower_redlock::axum::{LockKey, Locked};
use tower_redlock::http::key::{path_param, PathParam};

struct OrderId;

impl LockKey for OrderId {
    type Extractor = PathParam;
    fn extractor() -> PathParam {
        path_param("id")
    }
}

#[derive(Clone)]
struct AppState {
    _timeout: Duration,
}

#[axum::debug_handler(state = AppState)]
async fn pay(_lock: Locked<OrderId>) {}

fn main() {}
