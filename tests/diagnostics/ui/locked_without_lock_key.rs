// `Locked<K>` needs `K: LockKey`; `#[debug_handler]` names the argument at fault.
use tower_redlock::axum::Locked;
use tower_redlock::Redlock;

struct OrderId;

#[axum::debug_handler(state = Redlock)]
async fn pay(_lock: Locked<OrderId>) {}

fn main() {}
