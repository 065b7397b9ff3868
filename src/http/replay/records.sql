CREATE TABLE IF NOT EXISTS redlock_records (
    resource text PRIMARY KEY,
    token bigint NOT NULL,
    fingerprint bytea NOT NULL,
    data bytea,                      -- NULL: a pending marker
    transactional boolean NOT NULL DEFAULT false,
    orphaned_until timestamptz,      -- an interrupted attempt found: outcome unknown until then
    expires_at timestamptz NOT NULL
)
