-- A schedule without its own max_attempts (NULL): its jobs are enqueued as jobs without one are
-- (3, marked max_attempts_default), so the claiming drain applies the kind's from fleetless.toml.
ALTER TABLE {schema}.schedules ALTER COLUMN max_attempts DROP NOT NULL;
ALTER TABLE {schema}.schedules ALTER COLUMN max_attempts DROP DEFAULT;
