-- A server claims the deliveries it is about to attempt, so that with several
-- servers on one database a delivery is not sent twice at once: `claimed_by` names
-- the server, `claimed_until` (server clock, Unix seconds) ends the claim if that
-- server dies mid-attempt. NULL: not claimed.
ALTER TABLE webhook_deliveries ADD COLUMN claimed_by TEXT;
ALTER TABLE webhook_deliveries ADD COLUMN claimed_until REAL;
