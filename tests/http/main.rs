//! The HTTP level (`tower_redlock::http` and `tower_redlock::axum`) end to end: the
//! layer, the extractors, idempotent replay, and the two examples' routers, driven with
//! `ServiceExt::oneshot` over `MemoryNode`s or real `redis-server`s spawned by
//! `support` on free 127.0.0.1 ports.

#[path = "../support/http_client.rs"]
mod http_client;
#[path = "../support/mod.rs"]
mod support;

/// The orders demo, as it is served (`cargo run --example orders`).
#[path = "../../examples/orders/main.rs"]
mod orders_example;
/// The webhooks demo, as it is served (`cargo run --example webhooks`).
#[path = "../../examples/webhooks.rs"]
mod webhooks_example;

mod clients;
mod extract;
mod keys;
mod layer;
mod modes;
mod multi;
mod orders;
mod panics;
#[cfg(feature = "postgres")]
mod pg_tx;
mod replay;
mod sockets;
mod splits;
mod told;
mod transfers;
mod webhooks;
mod writes;
