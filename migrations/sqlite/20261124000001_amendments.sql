-- v1.1: amendments to a run's registration, each in force from its step on. The
-- runs table keeps the registration as first sent (what a repeated PUT is compared
-- with); the registration in force is it with these applied in step order.
CREATE TABLE amendments (
    run INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    step INTEGER NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (run, step)
) WITHOUT ROWID;
