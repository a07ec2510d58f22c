-- gradflow storage on PostgreSQL: the same tables and meanings as the SQLite
-- schema (migrations/sqlite), in PostgreSQL's types. Timestamps are server-clock
-- Unix seconds in DOUBLE PRECISION (REAL would be float4: ~2 minutes of resolution
-- at today's dates); every integer is BIGINT, the type the server binds.

CREATE TABLE runs (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id       TEXT             NOT NULL UNIQUE,
    name         TEXT,
    registration TEXT             NOT NULL,     -- normalized JSON, as first sent
    created_at   DOUBLE PRECISION NOT NULL,
    first_step   BIGINT,
    last_step    BIGINT,
    last_seen    DOUBLE PRECISION,              -- server clock of the last accepted batch
    step_count   BIGINT           NOT NULL DEFAULT 0,
    finished_at  DOUBLE PRECISION,
    version      BIGINT           NOT NULL DEFAULT 0, -- batches that changed the run
    -- A multi-rank run: when its oldest step still waiting for ranks began to wait.
    pending_since DOUBLE PRECISION
);

CREATE INDEX runs_by_created_at ON runs (created_at);
CREATE INDEX runs_pending ON runs (pending_since) WHERE pending_since IS NOT NULL;

-- The column dictionary: position `col` of a run's packed step values holds the
-- series (`kind`, `subject`).
CREATE TABLE columns (
    run     BIGINT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    col     BIGINT NOT NULL,
    kind    TEXT   NOT NULL,
    subject TEXT   NOT NULL,
    PRIMARY KEY (run, col),
    UNIQUE (run, kind, subject)
);

-- Step values in blocks of 64 steps of one stream (server/src/store/block.rs):
-- stream 0 holds the run's steps (combined across its ranks), stream r + 1 rank r's
-- own records. Already compressed, so PostgreSQL stores them out of line as they are
-- instead of trying to compress them again.
CREATE TABLE blocks (
    run    BIGINT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    stream BIGINT NOT NULL,
    block  BIGINT NOT NULL,             -- first step / 64
    mask   BIGINT NOT NULL,             -- bit i set: step 64·block + i is present
    vals   BYTEA  NOT NULL,
    PRIMARY KEY (run, stream, block)
);
ALTER TABLE blocks ALTER COLUMN vals SET STORAGE EXTERNAL;

-- Per stream, per bucket of `width` steps (64 and 4096), per chunk of 64 columns:
-- extremes with their offsets, first NaN, first null (server/src/store/rollup.rs).
CREATE TABLE rollups (
    run     BIGINT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    stream  BIGINT NOT NULL,
    width   BIGINT NOT NULL,
    chunk   BIGINT NOT NULL,
    bucket  BIGINT NOT NULL,
    summary BYTEA  NOT NULL,
    PRIMARY KEY (run, stream, width, chunk, bucket)
);
ALTER TABLE rollups ALTER COLUMN summary SET STORAGE EXTERNAL;

-- One row per episode of one kind on one subject (see the SQLite schema).
CREATE TABLE alerts (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run           BIGINT           NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    kind          TEXT             NOT NULL,
    severity      TEXT             NOT NULL CHECK (severity IN ('critical', 'warning', 'info')),
    subject       TEXT             NOT NULL,
    status        TEXT             NOT NULL CHECK (status IN ('open', 'resolved')),
    first_step    BIGINT,
    opened_step   BIGINT,
    last_step     BIGINT,
    resolved_step BIGINT,
    title         TEXT             NOT NULL,
    detail        TEXT             NOT NULL,
    fix           TEXT             NOT NULL,
    evidence      JSONB            NOT NULL,
    opened_at     DOUBLE PRECISION NOT NULL,
    resolved_at   DOUBLE PRECISION
);

CREATE INDEX alerts_by_run ON alerts (run, first_step);
-- At most one open episode of a kind on a subject: replicas take turns on a run
-- (its row lock), and this makes a second open episode an error, never a duplicate.
CREATE UNIQUE INDEX alerts_one_open ON alerts (run, kind, subject) WHERE status = 'open';

-- Each run's streaming detector state (JSON of detect::DetectorSet).
CREATE TABLE detector_state (
    run   BIGINT PRIMARY KEY REFERENCES runs (id) ON DELETE CASCADE,
    state TEXT   NOT NULL
);

-- v1.1 amendments to a run's registration, each in force from its step on.
CREATE TABLE amendments (
    run  BIGINT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    step BIGINT NOT NULL,
    body TEXT   NOT NULL,
    PRIMARY KEY (run, step)
);

-- Webhook receivers: the servers' own (`run` NULL) and each run's.
CREATE TABLE webhook_targets (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run          BIGINT REFERENCES runs (id) ON DELETE CASCADE,
    url          TEXT   NOT NULL,
    format       TEXT   NOT NULL CHECK (format IN ('generic', 'slack')),
    min_severity TEXT   NOT NULL CHECK (min_severity IN ('critical', 'warning', 'info'))
);

CREATE INDEX webhook_targets_by_run ON webhook_targets (run);

-- The notification queue and its log (see the SQLite schema). `claimed_by` is
-- attempting it, until `claimed_until` at most, so no other replica sends it
-- meanwhile.
CREATE TABLE webhook_deliveries (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run             BIGINT           NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    alert           BIGINT           NOT NULL REFERENCES alerts (id) ON DELETE CASCADE,
    action          TEXT             NOT NULL CHECK (action IN ('opened', 'resolved')),
    url             TEXT             NOT NULL,
    format          TEXT             NOT NULL CHECK (format IN ('generic', 'slack')),
    payload         TEXT             NOT NULL,
    status          TEXT             NOT NULL CHECK (status IN ('pending', 'delivered', 'failed', 'dropped')),
    attempts        BIGINT           NOT NULL DEFAULT 0,
    created_at      DOUBLE PRECISION NOT NULL,
    next_attempt_at DOUBLE PRECISION NOT NULL,
    last_attempt_at DOUBLE PRECISION,
    last_status     BIGINT,
    last_error      TEXT,
    delivered_at    DOUBLE PRECISION,
    claimed_by      TEXT,
    claimed_until   DOUBLE PRECISION
);

CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_by_run ON webhook_deliveries (run, id);
