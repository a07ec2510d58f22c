-- A run's trainer may say it has finished (POST /api/v1/runs/{run_id}/finish), so the
-- dashboard can tell a finished run from one whose trainer went quiet (stale).
ALTER TABLE runs ADD COLUMN finished_at REAL;   -- server clock, Unix seconds
