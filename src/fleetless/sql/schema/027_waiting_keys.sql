-- Keys with workflows (issue 29): a workflow's child may carry a key, and a child waiting for its
-- parents holds it as a pending or running job does, so an enqueue retried after a lost reply to
-- its COMMIT finds the child it wrote instead of writing another. The unique partial index now
-- covers 'waiting' too (005's covered pending and running). No keyed job could be waiting before
-- this (an enqueue with parents refused a key), so the new index cannot meet a duplicate.
CREATE UNIQUE INDEX IF NOT EXISTS jobs_live_key_idx ON {schema}.jobs (key)
  WHERE key IS NOT NULL AND status IN ('pending', 'running', 'waiting');
DROP INDEX IF EXISTS {schema}.jobs_key_idx;
