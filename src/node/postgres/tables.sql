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
-- The lock's calls, one function each: the server plans their statements once per
-- connection (PL/pgSQL keeps its plans), while a call goes inline in the simple query
-- protocol, which a pooler in transaction mode passes whole. Expiry is on the database's
-- clock. An acquire grants every key or nothing (a set's members written before a held
-- one are rolled back by an exception block), stepping each granted key's fence
-- counter; a refused key answers its holder's remaining ttl.
-- A function whose arguments or result change gets a new name (`CREATE OR REPLACE`
-- cannot change them), which the node's schema check names.
-- A granted key's fence counter: max(counter + 1, fence_floor), or the floor over an
-- expired counter; `seed_only` is the unsafe rule a test uses to show the floor matters.
CREATE OR REPLACE FUNCTION redlock_fence_step(counter bigint, expires_at timestamptz,
    fence_floor bigint, seed_only bool)
RETURNS bigint LANGUAGE sql AS $$
    SELECT CASE WHEN expires_at <= clock_timestamp() THEN fence_floor
                WHEN seed_only THEN counter + 1
                ELSE greatest(counter + 1, fence_floor) END
$$;
CREATE OR REPLACE FUNCTION redlock_acquire(lock_keys text[], fence_keys text[],
    lease_owner text, ttl_ms float8, fencing bool, fence_floor bigint, fence_ttl_ms float8,
    seed_only bool)
RETURNS TABLE (granted bool, fence bigint, pttl_ms bigint) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    grants bool[];
    fences bigint[];
    pttls bigint[];
BEGIN
    BEGIN
        WITH wanted AS (
            SELECT lock_key, fence_key, idx
            FROM unnest(lock_keys, fence_keys) WITH ORDINALITY AS w(lock_key, fence_key, idx)
        ), taken AS (
            INSERT INTO redlock_leases AS l (key, owner, expires_at)
            SELECT lock_key, lease_owner, clock_timestamp() + ttl_ms * interval '1 millisecond'
            FROM wanted ORDER BY idx
            ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at
            WHERE l.expires_at <= clock_timestamp() OR l.owner = EXCLUDED.owner
            RETURNING key
        ), fenced AS (
            INSERT INTO redlock_fence_counters AS c (key, counter, expires_at)
            SELECT fence_key, fence_floor,
                   clock_timestamp() + fence_ttl_ms * interval '1 millisecond'
            FROM wanted
            WHERE fencing AND (SELECT count(*) FROM taken) = cardinality(lock_keys)
            ORDER BY idx
            ON CONFLICT (key) DO UPDATE SET
                counter = redlock_fence_step(c.counter, c.expires_at, EXCLUDED.counter, seed_only),
                expires_at = EXCLUDED.expires_at
            RETURNING key, counter
        )
        SELECT array_agg(t.key IS NOT NULL ORDER BY w.idx), array_agg(f.counter ORDER BY w.idx),
               array_agg((extract(epoch FROM l.expires_at - clock_timestamp()) * 1000)::int8
                         ORDER BY w.idx)
        INTO grants, fences, pttls
        FROM wanted w
        LEFT JOIN taken t ON t.key = w.lock_key
        LEFT JOIN fenced f ON f.key = w.fence_key
        LEFT JOIN redlock_leases l ON t.key IS NULL AND l.key = w.lock_key;
        IF NOT (true = ALL (grants)) THEN
            -- The free members written before a held one was found are undone.
            RAISE EXCEPTION USING ERRCODE = 'RLREF';
        END IF;
    EXCEPTION WHEN SQLSTATE 'RLREF' THEN
        NULL;
    END;
    RETURN QUERY SELECT * FROM unnest(grants, fences, pttls);
END $$;
-- redlock_acquire of one key, the common case, on scalars: one row.
CREATE OR REPLACE FUNCTION redlock_acquire_one(lock_key text, fence_key text,
    lease_owner text, ttl_ms float8, fencing bool, fence_floor bigint, fence_ttl_ms float8,
    seed_only bool)
RETURNS TABLE (granted bool, fence bigint, pttl_ms bigint) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    WITH taken AS (
        INSERT INTO redlock_leases AS l (key, owner, expires_at)
        VALUES (lock_key, lease_owner, clock_timestamp() + ttl_ms * interval '1 millisecond')
        ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at
        WHERE l.expires_at <= clock_timestamp() OR l.owner = EXCLUDED.owner
        RETURNING key
    ), fenced AS (
        INSERT INTO redlock_fence_counters AS c (key, counter, expires_at)
        SELECT fence_key, fence_floor,
               clock_timestamp() + fence_ttl_ms * interval '1 millisecond'
        FROM taken WHERE fencing
        ON CONFLICT (key) DO UPDATE SET
            counter = redlock_fence_step(c.counter, c.expires_at, EXCLUDED.counter, seed_only),
            expires_at = EXCLUDED.expires_at
        RETURNING counter
    )
    SELECT EXISTS (SELECT FROM taken), (SELECT counter FROM fenced) INTO granted, fence;
    IF NOT granted THEN
        -- A statement of its own, so a snapshot of its own: a holder that committed
        -- while the acquire waited for its row is seen.
        SELECT (extract(epoch FROM l.expires_at - clock_timestamp()) * 1000)::int8
        INTO pttl_ms FROM redlock_leases AS l WHERE l.key = lock_key;
    END IF;
    RETURN NEXT;
END $$;
-- Every hold of a renewal at once (`holds`: each key's hold's index): the number of keys
-- extended per hold, compare-and-extend.
CREATE OR REPLACE FUNCTION redlock_extend(lock_keys text[], owners text[], holds bigint[],
    ttl_ms float8)
RETURNS TABLE (hold bigint, extended bigint) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY WITH done AS (
        UPDATE redlock_leases AS l
        SET expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond'
        FROM unnest(lock_keys, owners, holds) AS h(key, owner, hold)
        WHERE l.key = h.key AND l.owner = h.owner AND l.expires_at > clock_timestamp()
        RETURNING h.hold
    )
    SELECT done.hold, count(*) FROM done GROUP BY done.hold;
END $$;
-- Compare-and-delete (`channels`: the keys' channels as notifications name them); each
-- deleted key's channel notified when, and only if, this commits (`wake`). Answers how
-- many keys were the owner's and still live.
CREATE OR REPLACE FUNCTION redlock_release(lock_keys text[], channels text[],
    lease_owner text, wake bool)
RETURNS bigint LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    live bigint;
BEGIN
    WITH gone AS (
        DELETE FROM redlock_leases AS l USING unnest(lock_keys, channels) AS r(key, channel)
        WHERE l.key = r.key AND l.owner = lease_owner
        RETURNING r.channel, l.expires_at > clock_timestamp() AS live
    )
    SELECT count(*) FILTER (WHERE gone.live),
           count(CASE WHEN wake THEN pg_notify('redlock_released', gone.channel) END)
    INTO live FROM gone;
    RETURN live;
END $$;
-- redlock_release of one key.
CREATE OR REPLACE FUNCTION redlock_release_one(lock_key text, channel text,
    lease_owner text, wake bool)
RETURNS bigint LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    live bigint;
BEGIN
    WITH gone AS (
        DELETE FROM redlock_leases AS l WHERE l.key = lock_key AND l.owner = lease_owner
        RETURNING l.expires_at > clock_timestamp() AS live
    )
    SELECT count(*) FILTER (WHERE gone.live),
           count(CASE WHEN wake THEN pg_notify('redlock_released', channel) END)
    INTO live FROM gone;
    RETURN live;
END $$;
-- Raises each fence counter to at least its token.
CREATE OR REPLACE FUNCTION redlock_raise(fence_keys text[], tokens bigint[],
    fence_ttl_ms float8)
RETURNS void LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    INSERT INTO redlock_fence_counters AS c (key, counter, expires_at)
    SELECT r.key, r.token, clock_timestamp() + fence_ttl_ms * interval '1 millisecond'
    FROM unnest(fence_keys, tokens) AS r(key, token)
    ON CONFLICT (key) DO UPDATE SET
        counter = CASE WHEN c.expires_at <= clock_timestamp() THEN EXCLUDED.counter
                       ELSE greatest(c.counter, EXCLUDED.counter) END,
        expires_at = EXCLUDED.expires_at;
END $$;
-- Whether `lease_owner` holds `lock_key` now.
CREATE OR REPLACE FUNCTION redlock_owns(lock_key text, lease_owner text)
RETURNS bool LANGUAGE sql AS $$
    SELECT EXISTS (SELECT FROM redlock_leases AS l WHERE l.key = lock_key
        AND l.owner = lease_owner AND l.expires_at > clock_timestamp())
$$;
-- Outcome records. A claim and a store of one record wait for each other (a lock held
-- until the call's transaction ends), and each statement after it reads afresh.
-- A claim: `$1` record key, `$2` lock key, `$3` owner, `$4` token, `$5` fingerprint, `$6`
-- pending ttl ms, `$7` orphan ttl ms or NULL, `$8` interrupted key, `$9` remember ms or
-- NULL. Answers the case, the record's columns, its pttl and the interrupted token.
CREATE OR REPLACE FUNCTION redlock_claim_record(text, text, text, bigint, bytea, float8,
    float8, text, float8)
RETURNS TABLE (outcome text, record_token bigint, record_fingerprint bytea,
    record_data bytea, pttl_ms bigint, interrupted_token bigint) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(72626, hashtext($1));
    RETURN QUERY WITH cur AS (
        SELECT * FROM redlock_node_records WHERE key = $1 AND expires_at > clock_timestamp()
    ), state AS (
        SELECT CASE
            WHEN EXISTS (SELECT 1 FROM cur WHERE data IS NOT NULL) THEN 'completed'
            WHEN NOT redlock_owns($2, $3) THEN 'not_owner'
            WHEN EXISTS (SELECT 1 FROM cur WHERE token = $4) THEN 'claimed'
            WHEN EXISTS (SELECT 1 FROM cur) THEN 'orphaned'
            ELSE 'claim' END AS s
    ), orphaned AS (
        UPDATE redlock_node_records AS r SET orphan = true, expires_at = coalesce(
            clock_timestamp() + $7 * interval '1 millisecond', r.expires_at)
        WHERE r.key = $1 AND NOT r.orphan AND (SELECT s FROM state) = 'orphaned'
        RETURNING r.token, r.expires_at
    ), remembered AS (
        INSERT INTO redlock_node_records AS r (key, token, fingerprint, expires_at)
        SELECT $8, o.token, '', clock_timestamp() + $9 * interval '1 millisecond'
        FROM orphaned AS o WHERE $9 IS NOT NULL
        ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token, expires_at = EXCLUDED.expires_at
    ), claimed AS (
        INSERT INTO redlock_node_records AS r (key, token, fingerprint, expires_at)
        SELECT $1, $4, $5, clock_timestamp() + $6 * interval '1 millisecond'
        WHERE (SELECT s FROM state) = 'claim'
        ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token,
            fingerprint = EXCLUDED.fingerprint, data = NULL, orphan = false,
            expires_at = EXCLUDED.expires_at
    )
    SELECT (SELECT s FROM state), c.token, c.fingerprint, c.data,
        (extract(epoch FROM coalesce((SELECT expires_at FROM orphaned), c.expires_at)
            - clock_timestamp()) * 1000)::int8,
        (SELECT i.token FROM redlock_node_records AS i
         WHERE i.key = $8 AND i.expires_at > clock_timestamp())
    FROM (SELECT 1) AS one LEFT JOIN cur AS c ON true;
END $$;
-- A store: `$1` record key, `$2` lock key, `$3` owner, `$4` token, `$5` fingerprint, `$6`
-- data, `$7` retention ms. Answers the case.
CREATE OR REPLACE FUNCTION redlock_store_record(text, text, text, bigint, bytea, bytea,
    float8)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    outcome text;
BEGIN
    PERFORM pg_advisory_xact_lock(72626, hashtext($1));
    WITH cur AS (
        SELECT * FROM redlock_node_records
        WHERE key = $1 AND data IS NOT NULL AND expires_at > clock_timestamp()
    ), state AS (
        SELECT CASE
            WHEN NOT redlock_owns($2, $3) THEN 'not_owner'
            WHEN EXISTS (SELECT 1 FROM cur WHERE token = $4 AND fingerprint = $5 AND data = $6)
                THEN 'stored'
            WHEN EXISTS (SELECT 1 FROM cur WHERE token >= $4) THEN 'superseded'
            ELSE 'store' END AS s
    ), stored AS (
        INSERT INTO redlock_node_records AS r (key, token, fingerprint, data, expires_at)
        SELECT $1, $4, $5, $6, clock_timestamp() + $7 * interval '1 millisecond'
        WHERE (SELECT s FROM state) = 'store'
        ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token,
            fingerprint = EXCLUDED.fingerprint, data = EXCLUDED.data, orphan = false,
            expires_at = EXCLUDED.expires_at
    )
    SELECT s INTO outcome FROM state;
    RETURN outcome;
END $$;
