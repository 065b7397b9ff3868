//! The request's slot for the handler's transaction: where a [`Tx`](crate::axum::Tx)
//! takes it and leaves it, and where the layer finds it to record the response in it.

use std::sync::{Arc, Mutex};

use sqlx::{Postgres, Transaction};

use super::PgRecords;

/// Where a [`Tx`](crate::axum::Tx) finds the records' pool, and leaves its transaction
/// when the handler is done with it, for the layer to record the response in it and
/// commit. Put in the request's extensions by a layer with records in PostgreSQL.
#[cfg_attr(not(feature = "axum"), allow(dead_code))]
#[derive(Clone)]
pub(crate) struct TxSlot {
    pub(crate) records: PgRecords,
    pub(crate) state: Arc<Mutex<TxState>>,
}

#[cfg_attr(not(feature = "axum"), allow(dead_code))]
#[derive(Default)]
pub(crate) enum TxState {
    /// No transaction taken (yet).
    #[default]
    Free,
    /// The transaction the marker was claimed in ([`PgRecords::handlers_take_tx`]),
    /// for the handler's [`Tx`](crate::axum::Tx); `fenced`: the lease's fence advanced in it.
    Begun {
        tx: Transaction<'static, Postgres>,
        fenced: bool,
    },
    /// A [`Tx`](crate::axum::Tx) holds it.
    Taken,
    /// The handler is done with it: for the layer to commit.
    Returned(Transaction<'static, Postgres>),
}

impl TxSlot {
    /// The slot's state, left `Taken` so that no `Tx` begins after the handler.
    pub(crate) fn close(&self) -> TxState {
        let mut state = crate::lock_unpoisoned(&self.state);
        std::mem::replace(&mut *state, TxState::Taken)
    }
}
