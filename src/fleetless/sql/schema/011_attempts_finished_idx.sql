-- The dashboard's chart counts attempts that ended per minute over the last hours (insight_per_minute):
-- this index lets it read only that window of the attempt history, whatever the history's size.
CREATE INDEX IF NOT EXISTS job_attempts_finished_idx ON {schema}.job_attempts (finished_at);
