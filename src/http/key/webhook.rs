//! Keys of well-known webhook senders: each delivery is processed once at a time, so
//! a retried delivery waits for (or is refused during) the first one.

use super::{header, json_field, Header, JsonField, KeyExtractor, Or};

/// GitHub: the `X-GitHub-Delivery` header (a GUID per delivery, kept on redelivery).
pub fn github() -> Header {
    header("x-github-delivery")
}

/// Stripe: the event id, the body field `/id` (e.g. `evt_1Nx…`). The body reaches
/// the handler unchanged, so `Stripe-Signature` still verifies.
pub fn stripe() -> JsonField {
    json_field("/id")
}

/// Shopify: the `X-Shopify-Event-Id` header, or `X-Shopify-Webhook-Id` when absent
/// (older API versions).
pub fn shopify() -> Or<Header, Header> {
    header("x-shopify-event-id").or(header("x-shopify-webhook-id"))
}
