-- Alert notifications to webhooks (docs/PROTOCOL.md, "Webhooks").
--
-- Where to send: the server's own receivers (`--webhook`, `run` NULL, replaced at
-- every start) and each run's (its registration's `webhooks`).
CREATE TABLE webhook_targets (
    id           INTEGER PRIMARY KEY,
    run          INTEGER REFERENCES runs (id) ON DELETE CASCADE,
    url          TEXT    NOT NULL,
    format       TEXT    NOT NULL CHECK (format IN ('generic', 'slack')),
    min_severity TEXT    NOT NULL CHECK (min_severity IN ('critical', 'warning', 'info'))
);

CREATE INDEX webhook_targets_by_run ON webhook_targets (run);

-- The queue and its log: one row per alert transition per receiver, written in the
-- transaction that opened or resolved the alert, so no notification is lost to a
-- crash and none is sent for a transition that was rolled back. `payload` is the
-- alert as it was at the transition (JSON of the API's alert object).
CREATE TABLE webhook_deliveries (
    id              INTEGER PRIMARY KEY,
    run             INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    alert           INTEGER NOT NULL REFERENCES alerts (id) ON DELETE CASCADE,
    action          TEXT    NOT NULL CHECK (action IN ('opened', 'resolved')),
    url             TEXT    NOT NULL,
    format          TEXT    NOT NULL CHECK (format IN ('generic', 'slack')),
    payload         TEXT    NOT NULL,
    status          TEXT    NOT NULL CHECK (status IN ('pending', 'delivered', 'failed', 'dropped')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    created_at      REAL    NOT NULL,           -- server clock, Unix seconds
    next_attempt_at REAL    NOT NULL,
    last_attempt_at REAL,
    last_status     INTEGER,                    -- HTTP status of the last attempt
    last_error      TEXT,
    delivered_at    REAL
);

CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_by_run ON webhook_deliveries (run, id);
