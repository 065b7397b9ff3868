//! The examples of `tower-redlock` (`orders`, `webhooks`, `manual`), a package of their
//! own so that `cargo run --example orders` builds only what they need.
