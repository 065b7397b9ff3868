//! The node contract (`tower_redlock::node::conformance`), run on the memory node and
//! on a real `redis-server`.
use crate::support;

use std::sync::Arc;

use support::RedisServer;
use tower_redlock::node::conformance::{check, Contract};
use tower_redlock::node::Node;
use tower_redlock::{MemoryNode, RedisNode};

#[tokio::test]
async fn the_memory_node_keeps_the_contract() {
    let node = MemoryNode::new();
    check(
        &|| Arc::new(node.clone()) as Arc<dyn Node>,
        Contract::default(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_node_keeps_the_contract() {
    let server = RedisServer::start();
    let url = server.url();
    let make = || Arc::new(RedisNode::open(url.as_str()).unwrap()) as Arc<dyn Node>;
    check(&make, Contract::default()).await;
}
