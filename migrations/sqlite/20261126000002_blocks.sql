-- Step values in blocks of 64 steps (server/src/store/block.rs: columns laid out
-- together and compressed with pco) instead of one row per step, and a stream per
-- rank of a multi-rank run: stream 0 holds the run's steps (combined across its
-- ranks), stream r + 1 rank r's own records. gradflow-server moves the rows of the
-- old `steps` table into blocks when it starts, run by run, then drops the table
-- (server/src/store/sqlite.rs).
CREATE TABLE blocks (
    run    INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    stream INTEGER NOT NULL,
    block  INTEGER NOT NULL,            -- first step / 64
    mask   INTEGER NOT NULL,            -- bit i set: step 64·block + i is present
    vals   BLOB    NOT NULL,
    UNIQUE (run, stream, block)
);

-- Rollups per stream: the same summaries, keyed by stream too.
CREATE TABLE rollups_by_stream (
    run     INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    stream  INTEGER NOT NULL,
    width   INTEGER NOT NULL,
    chunk   INTEGER NOT NULL,
    bucket  INTEGER NOT NULL,
    summary BLOB    NOT NULL,
    UNIQUE (run, stream, width, chunk, bucket)
);
INSERT INTO rollups_by_stream (run, stream, width, chunk, bucket, summary)
    SELECT run, 0, width, chunk, bucket, summary FROM rollups;
DROP TABLE rollups;
ALTER TABLE rollups_by_stream RENAME TO rollups;

-- How many batches have changed the run: what a server checks its cached state of
-- the run against (its last step alone does not move with every batch of a
-- multi-rank run).
ALTER TABLE runs ADD COLUMN version INTEGER NOT NULL DEFAULT 0;

-- A multi-rank run: when its oldest step still waiting for some ranks' records
-- began to wait (server clock, Unix seconds); NULL when none waits. What the server
-- looks for to complete steps whose ranks stopped reporting.
ALTER TABLE runs ADD COLUMN pending_since REAL;
CREATE INDEX runs_pending ON runs (pending_since) WHERE pending_since IS NOT NULL;
