-- One row per held lock key; a row past expires_at is free (the next acquire takes it).
CREATE TABLE IF NOT EXISTS redlock_leases (
    key text PRIMARY KEY,
    owner text NOT NULL,
    expires_at timestamptz NOT NULL
);
-- One fence counter per resource; a row past expires_at counts as missing.
CREATE TABLE IF NOT EXISTS redlock_fence_counters (
    key text PRIMARY KEY,
    counter bigint NOT NULL CHECK (counter >= 0),
    expires_at timestamptz NOT NULL
);
-- Outcome records (idempotent replay): a completed record (data set), a pending marker
-- (data NULL), or an interrupted attempt's token (under the `…:interrupted` key).
-- Not `redlock_records`: replay's own table (`PgRecords`) may share the database.
CREATE TABLE IF NOT EXISTS redlock_node_records (
    key text PRIMARY KEY,
    token bigint NOT NULL,
    fingerprint bytea NOT NULL,
    data bytea,
    orphan boolean NOT NULL DEFAULT false,
    expires_at timestamptz NOT NULL
);
