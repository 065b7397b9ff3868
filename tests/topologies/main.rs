//! Nodes that are more than one server: a Redis Cluster as one vote, Sentinel-managed
//! masters followed across failovers (with ACLs, passwords and, with `tls`, TLS), and
//! etcd clusters (feature `etcd`). Every server is spawned by `support` on free
//! 127.0.0.1 ports.

#[path = "../support/mod.rs"]
mod support;

mod cluster;
#[cfg(all(feature = "etcd", feature = "axum"))]
mod etcd;
mod modes;
#[cfg(feature = "postgres")]
mod pg_standby;
#[cfg(feature = "postgres")]
mod postgres;
mod sets;
mod waiting_order;
