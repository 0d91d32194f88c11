-- What the read service (fleetless.insights: CLI reports, dashboard, /metrics) needs from the table.

-- Who holds a running job: the drainer's "host:pid" and its sandbox tier, written by the claim, so
-- the dashboard can say where each running job is without asking any drainer.
ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS claimed_by text;
ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS tier text;
