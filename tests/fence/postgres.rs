//! `fence::postgres` against the local PostgreSQL: the rule, atomicity with the
//! application's writes, sets, the table's name, the token range.

use sqlx::{Connection, PgConnection};
use tower_redlock::fence::postgres::{self as pg, FenceTable};
use tower_redlock::fence::{self, FenceError};
use tower_redlock::{FencingToken, LockMode, Redlock, Resource};

use crate::held;
use crate::support::postgres::TestDatabase;

async fn with_table() -> (TestDatabase, PgConnection) {
    let db = TestDatabase::create().await;
    let mut conn = db.connect().await;
    FenceTable::default().create(&mut conn).await.unwrap();
    sqlx::query("CREATE TABLE notes (body text NOT NULL)")
        .execute(&mut conn)
        .await
        .unwrap();
    (db, conn)
}

async fn notes(conn: &mut PgConnection) -> Vec<String> {
    sqlx::query_scalar("SELECT body FROM notes ORDER BY body")
        .fetch_all(conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_fence_only_moves_up_and_refuses_a_smaller_token_with_the_current_one() {
    let (_db, mut conn) = with_table().await;
    let table = FenceTable::default();
    let order = Resource::from("order:1");

    pg::advance(&mut conn, &held("order:1", 10)).await.unwrap();
    assert_eq!(
        table.current(&mut conn, &order).await.unwrap(),
        Some(FencingToken::new(10))
    );

    match pg::advance(&mut conn, &held("order:1", 9)).await {
        Err(FenceError::Stale {
            fence,
            token,
            current,
        }) => {
            assert_eq!(fence, "order:1");
            assert_eq!(token, FencingToken::new(9));
            assert_eq!(current, FencingToken::new(10));
        }
        other => panic!("expected Stale, got {other:?}"),
    }
    // The same lease writing again finds its own token: accepted, unchanged.
    pg::advance(&mut conn, &held("order:1", 10)).await.unwrap();
    pg::advance(&mut conn, &held("order:1", 11)).await.unwrap();
    assert_eq!(
        table.current(&mut conn, &order).await.unwrap(),
        Some(FencingToken::new(11))
    );
    // Another resource has its own fence.
    pg::advance(&mut conn, &held("order:2", 1)).await.unwrap();
    assert_eq!(
        table
            .current(&mut conn, &Resource::from("order:2"))
            .await
            .unwrap(),
        Some(FencingToken::new(1))
    );
}

#[tokio::test]
async fn a_stale_transaction_commits_nothing_and_the_newer_write_stays() {
    let (_db, mut conn) = with_table().await;

    let mut newer = conn.begin().await.unwrap();
    pg::advance(&mut newer, &held("doc", 20)).await.unwrap();
    sqlx::query("INSERT INTO notes VALUES ('newer')")
        .execute(&mut *newer)
        .await
        .unwrap();
    newer.commit().await.unwrap();

    let mut older = conn.begin().await.unwrap();
    // The application's write first, the fence after: both in one transaction.
    sqlx::query("INSERT INTO notes VALUES ('older')")
        .execute(&mut *older)
        .await
        .unwrap();
    let refused = pg::advance(&mut older, &held("doc", 19)).await.unwrap_err();
    assert_eq!(refused.current(), Some(FencingToken::new(20)));
    drop(older); // rolls back

    assert_eq!(notes(&mut conn).await, ["newer"]);
    assert_eq!(
        FenceTable::default()
            .current(&mut conn, &Resource::from("doc"))
            .await
            .unwrap(),
        Some(FencingToken::new(20))
    );
}

#[tokio::test]
async fn a_set_lease_advances_one_fence_per_member_or_none() {
    let (_db, mut conn) = with_table().await;
    let locker = Redlock::in_memory();
    let lease = locker
        .try_acquire_all(["account:a", "account:b"])
        .await
        .unwrap();
    let table = FenceTable::default();

    let mut tx = conn.begin().await.unwrap();
    pg::advance(&mut tx, &lease).await.unwrap();
    tx.commit().await.unwrap();
    for (resource, token) in lease.fencing_tokens() {
        assert_eq!(
            table.current(&mut conn, resource).await.unwrap(),
            Some(token)
        );
    }

    // A later holder of `account:b` alone wrote; the set's statement moves neither fence.
    let b = Resource::from("account:b");
    let a = Resource::from("account:a");
    let b_token = lease.fencing_token_of(&b).unwrap();
    let later = (b.clone(), FencingToken::new(b_token.get() + 5));
    pg::advance(&mut conn, &later).await.unwrap();
    let a_next = FencingToken::new(lease.fencing_token_of(&a).unwrap().get() + 1);
    let stale_set = Pairs(vec![(a.clone(), a_next), (b.clone(), b_token)]);
    let mut tx = conn.begin().await.unwrap();
    let refused = pg::advance(&mut tx, &stale_set).await.unwrap_err();
    match refused {
        FenceError::Stale { fence, current, .. } => {
            assert_eq!(fence, b.as_str());
            assert_eq!(current, later.1);
        }
        other => panic!("expected Stale, got {other:?}"),
    }
    drop(tx);
    assert_eq!(
        table.current(&mut conn, &a).await.unwrap(),
        lease.fencing_token_of(&a)
    );
}

/// Several resources with their tokens, as a test's own `Fenced`.
struct Pairs(Vec<(Resource, FencingToken)>);

impl fence::Fenced for Pairs {
    fn tokens(&self) -> Vec<(Resource, FencingToken)> {
        self.0.clone()
    }

    fn mode(&self) -> LockMode {
        LockMode::Exclusive
    }
}

#[tokio::test]
async fn a_token_past_bigint_is_refused_before_anything_is_sent() {
    let (_db, mut conn) = with_table().await;
    let huge = held("big", i64::MAX as u64 + 1);
    let refused = pg::advance(&mut conn, &huge).await.unwrap_err();
    assert!(
        matches!(refused, FenceError::OutOfRange { token } if token == huge.1),
        "{refused:?}"
    );
    assert_eq!(
        FenceTable::default()
            .current(&mut conn, &huge.0)
            .await
            .unwrap(),
        None
    );
    // The largest that fits goes through.
    pg::advance(&mut conn, &held("big", i64::MAX as u64))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_table_of_another_name_in_another_schema() {
    let db = TestDatabase::create().await;
    let mut conn = db.connect().await;
    sqlx::query("CREATE SCHEMA billing")
        .execute(&mut conn)
        .await
        .unwrap();
    let table = FenceTable::new("billing.Fences").unwrap();
    assert!(table.create_sql().contains("\"billing\".\"Fences\""));
    table.create(&mut conn).await.unwrap();
    table.create(&mut conn).await.unwrap(); // idempotent
    table.advance(&mut conn, &held("x", 2)).await.unwrap();
    assert!(table
        .advance(&mut conn, &held("x", 1))
        .await
        .unwrap_err()
        .is_stale());
    // The default table does not exist here: a database error, not Stale.
    let missing = pg::advance(&mut conn, &held("x", 3)).await.unwrap_err();
    assert!(matches!(missing, FenceError::Store(_)), "{missing:?}");

    for bad in ["", "a;drop", "1abc", "a.b.c", "x\"y", "a b"] {
        assert!(FenceTable::new(bad).is_err(), "{bad:?} accepted");
    }
}

#[tokio::test]
async fn a_row_carrying_its_own_fence_column() {
    let db = TestDatabase::create().await;
    let mut conn = db.connect().await;
    sqlx::query(
        "CREATE TABLE orders (id bigint PRIMARY KEY, status text NOT NULL,
                              fence_token bigint NOT NULL DEFAULT 0)",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query("INSERT INTO orders (id, status) VALUES (1, 'new')")
        .execute(&mut conn)
        .await
        .unwrap();
    let write = |token: u64, status: &'static str| {
        let token = fence::to_i64(FencingToken::new(token)).unwrap();
        sqlx::query(
            "UPDATE orders SET status = $3, fence_token = $2 WHERE id = $1 AND fence_token <= $2",
        )
        .bind(1_i64)
        .bind(token)
        .bind(status)
    };
    assert_eq!(
        write(5, "paid")
            .execute(&mut conn)
            .await
            .unwrap()
            .rows_affected(),
        1
    );
    assert_eq!(
        write(4, "stale")
            .execute(&mut conn)
            .await
            .unwrap()
            .rows_affected(),
        0
    );
    let status: String = sqlx::query_scalar("SELECT status FROM orders WHERE id = 1")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(status, "paid");
}
