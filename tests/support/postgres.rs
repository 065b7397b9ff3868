//! A database of its own on the PostgreSQL server at `$TOWER_REDLOCK_PG` (default
//! `postgres://postgres@127.0.0.1:5432`, trust auth, as `.ci/run` sets up): created
//! per test, dropped (`WITH (FORCE)`) when the [`TestDatabase`] is dropped, also after
//! a panic. Never touches another database.

use std::sync::atomic::{AtomicUsize, Ordering};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

/// The server, without a database.
pub fn server_url() -> String {
    std::env::var("TOWER_REDLOCK_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// A fresh database, dropped with this value.
pub struct TestDatabase {
    name: String,
    url: String,
}

impl TestDatabase {
    /// Creates `tower_redlock_test_<pid>_<n>_<random>`.
    pub async fn create() -> TestDatabase {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "tower_redlock_test_{}_{}_{:08x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            rand::random::<u32>()
        );
        let mut admin = admin().await;
        sqlx::query(&format!("CREATE DATABASE \"{name}\""))
            .execute(&mut admin)
            .await
            .expect("CREATE DATABASE");
        let _ = admin.close().await;
        let url = format!("{}/{name}", server_url());
        TestDatabase { name, url }
    }

    /// Its URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A pool of `size` connections to it.
    pub async fn pool(&self, size: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(size)
            .connect(&self.url)
            .await
            .expect("connect to the test database")
    }

    /// One connection to it.
    pub async fn connect(&self) -> PgConnection {
        self.url
            .parse::<PgConnectOptions>()
            .expect("test database URL")
            .connect()
            .await
            .expect("connect to the test database")
    }
}

async fn admin() -> PgConnection {
    let url = format!("{}/postgres", server_url());
    PgConnection::connect(&url).await.unwrap_or_else(|e| {
        panic!("PostgreSQL at {url} (set TOWER_REDLOCK_PG, or run .ci/run to set it up): {e}")
    })
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop may run inside a runtime: a thread of its own with its own runtime.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async {
                let mut admin = admin().await;
                sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                    .execute(&mut admin)
                    .await
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(_))) {
            eprintln!("could not drop test database {}: {dropped:?}", self.name);
        }
    }
}
