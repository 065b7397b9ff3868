use std::future::Future;

use super::*;

#[test]
fn a_turn_goes_to_the_next_caller_when_dropped_and_only_then() {
    let queues = Arc::new(Queues::default());
    let resource = Resource::new("r");
    let first = queues.get(&resource);
    let second = queues.get(&resource);
    let turn = first.try_turn().expect("nobody holds the resource");
    assert!(second.try_turn().is_none());
    let mut waiting = Box::pin(second.turn());
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(waiting.as_mut().poll(&mut cx).is_pending());
    drop(turn);
    let std::task::Poll::Ready(Some(next)) = waiting.as_mut().poll(&mut cx) else {
        panic!("the turn was not handed on");
    };
    assert!(first.try_turn().is_none());
    drop(next);
    // A caller that gave up waiting took nothing.
    let held = first.try_turn().expect("free again");
    let mut gave_up = Box::pin(second.turn());
    assert!(gave_up.as_mut().poll(&mut cx).is_pending());
    drop(gave_up);
    drop(held);
    assert!(second.try_turn().is_some());
}
