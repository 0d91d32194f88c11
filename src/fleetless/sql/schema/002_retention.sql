-- Retention deletes finished jobs by age, oldest first, a small batch per drain: this index finds
-- the oldest finished rows without reading the pending and running ones (or all of the table).
CREATE INDEX IF NOT EXISTS jobs_finished_idx ON {schema}.jobs (finished_at)
  WHERE status IN ('done', 'cancelled', 'dead');
