-- The rollup levels a run's buckets are complete for (see the SQLite migration of
-- the same name): runs registered from now on have all three levels, those
-- registered before keep to the two they had.
ALTER TABLE runs ADD COLUMN rollup_widths TEXT NOT NULL DEFAULT '64,1024,4096';
UPDATE runs SET rollup_widths = '64,4096';
