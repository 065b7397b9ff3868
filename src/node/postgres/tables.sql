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
