use super::*;

fn step() -> Step {
    Step {
        lease: Weak::new(),
        kind: Kind::Renew,
    }
}

/// Registers lease `id`, due at `at`, as `register` does.
fn register(schedule: &mut Schedule, id: u64, at: Instant) {
    schedule.registered.insert(id, Place::Fresh);
    schedule.add_fresh(at, id, step());
}

#[test]
fn leases_that_left_leave_the_fresh_list_and_it_stays_bounded() {
    let mut schedule = Schedule::default();
    let start = Instant::now();
    let mut live = Vec::new();
    for id in 0..10 * FRESH_LIMIT as u64 {
        register(&mut schedule, id, start + Duration::from_millis(id));
        assert!(schedule.fresh.len() <= FRESH_LIMIT);
        // One lease in ten is still held; the others are released at once, as a
        // `Registration` leaves (its entry stays in `fresh`).
        if id % 10 == 0 {
            live.push(id);
        } else {
            schedule.registered.remove(&id);
        }
    }
    // Once a sweep found more than half of the list live, all of it moved to `due`.
    assert!(schedule.due.len() < live.len());
    schedule.settle_fresh();
    assert!(schedule.fresh.is_empty());
    let due: Vec<u64> = schedule.due.keys().map(|&(_, id)| id).collect();
    assert_eq!(due, live);
    for id in live {
        let at = start + Duration::from_millis(id);
        assert!(matches!(schedule.registered[&id], Place::Due(due) if due == at));
    }
}

#[test]
fn the_earliest_lease_may_be_fresh() {
    let mut schedule = Schedule::default();
    let start = Instant::now();
    assert_eq!(schedule.first_due(), None);
    register(&mut schedule, 0, start + Duration::from_secs(10));
    schedule.settle_fresh();
    assert_eq!(schedule.first_due(), Some(start + Duration::from_secs(10)));
    register(&mut schedule, 1, start + Duration::from_secs(5));
    register(&mut schedule, 2, start + Duration::from_secs(7));
    assert_eq!(schedule.first_due(), Some(start + Duration::from_secs(5)));
    schedule.settle_fresh();
    assert_eq!(schedule.first_due(), Some(start + Duration::from_secs(5)));
    assert_eq!(schedule.due.len(), 3);
}
