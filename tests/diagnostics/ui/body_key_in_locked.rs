// `Locked` reads only the request head: a body key is refused where it is named.
use tower_redlock::axum::LockKey;
use tower_redlock::http::key::{json_field, JsonField};

struct PaymentId;

impl LockKey for PaymentId {
    type Extractor = JsonField;
    fn extractor() -> JsonField {
        json_field("/id")
    }
}

fn main() {}
