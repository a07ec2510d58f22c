-- The rollup levels a run's buckets are complete for (a comma-separated list of
-- bucket widths; core/src/columnar/rollup.rs). A run registered from now on has all
-- three from its first step; one registered before the 1,024-step level gets that
-- level's buckets only from where it goes on after the upgrade, so its reads keep
-- to the two levels it had.
ALTER TABLE runs ADD COLUMN rollup_widths TEXT NOT NULL DEFAULT '64,1024,4096';
UPDATE runs SET rollup_widths = '64,4096';
