-- gradflow storage, v1. See ARCHITECTURE.md ("Storage") for the design and its arithmetic.

-- One row per registered run. `id` is the compact key every other table uses;
-- `run_id` is the client's name for it.
CREATE TABLE runs (
    id           INTEGER PRIMARY KEY,
    run_id       TEXT    NOT NULL UNIQUE,
    name         TEXT,
    registration TEXT    NOT NULL,          -- normalized JSON body, compared on re-registration
    created_at   REAL    NOT NULL,          -- server clock, Unix seconds
    first_step   INTEGER,
    last_step    INTEGER,
    last_seen    REAL,                      -- server clock of the last accepted batch
    step_count   INTEGER NOT NULL DEFAULT 0
);

CREATE INDEX runs_by_created_at ON runs (created_at);

-- The column dictionary: position `col` of a run's packed step values holds the
-- series (`kind`, `subject`). Positions are dense, handed out in order of first use.
CREATE TABLE columns (
    run     INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    col     INTEGER NOT NULL,
    kind    TEXT    NOT NULL,
    subject TEXT    NOT NULL,               -- '' for run-wide series (loss, lr, ...)
    PRIMARY KEY (run, col),
    UNIQUE (run, kind, subject)
) WITHOUT ROWID;

-- One row per step: every value of the step packed into one compressed blob (see
-- server/src/store/codec.rs). A rowid table, because rows are ~1 KiB: in a WITHOUT
-- ROWID table whole rows would sit in the interior pages and ruin the fan-out.
CREATE TABLE steps (
    run    INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    step   INTEGER NOT NULL,
    time   REAL,                            -- the client's timestamp, Unix seconds
    vals   BLOB    NOT NULL,
    UNIQUE (run, step)
);

-- Per bucket of `width` steps (64 and 4096), per column: extremes with their
-- offsets, first NaN, first null (see server/src/store/rollup.rs). Stored in chunks
-- of 64 columns so that reading one series decompresses one chunk per bucket; the
-- key order makes a series read one contiguous range.
CREATE TABLE rollups (
    run     INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    width   INTEGER NOT NULL,
    chunk   INTEGER NOT NULL,               -- column / 64
    bucket  INTEGER NOT NULL,               -- first step of the bucket / width
    summary BLOB    NOT NULL,
    UNIQUE (run, width, chunk, bucket)
);
