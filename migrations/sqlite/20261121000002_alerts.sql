-- Alerts and detector state. See server/src/detect/ for the detectors.

-- One row per episode of one kind on one subject. Opened by a detector on the step
-- that completed its threshold (`opened_step`; the episode itself began at
-- `first_step`), or at registration with both NULL; resolved on the first step
-- where the condition no longer held.
CREATE TABLE alerts (
    id            INTEGER PRIMARY KEY,
    run           INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    kind          TEXT    NOT NULL,
    severity      TEXT    NOT NULL CHECK (severity IN ('critical', 'warning', 'info')),
    subject       TEXT    NOT NULL,
    status        TEXT    NOT NULL CHECK (status IN ('open', 'resolved')),
    first_step    INTEGER,
    opened_step   INTEGER,
    last_step     INTEGER,
    resolved_step INTEGER,
    title         TEXT    NOT NULL,
    detail        TEXT    NOT NULL,
    fix           TEXT    NOT NULL,
    evidence      TEXT    NOT NULL,           -- JSON
    opened_at     REAL    NOT NULL,           -- server clock, Unix seconds
    resolved_at   REAL
);

CREATE INDEX alerts_by_run ON alerts (run, first_step);
CREATE INDEX alerts_open ON alerts (status, run) WHERE status = 'open';

-- Each run's streaming detector state (JSON of detect::DetectorSet), written in the
-- transaction of every batch so a restarted server continues every streak.
CREATE TABLE detector_state (
    run   INTEGER PRIMARY KEY REFERENCES runs (id) ON DELETE CASCADE,
    state TEXT    NOT NULL
);
