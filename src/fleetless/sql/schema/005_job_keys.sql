-- Job keys: at most one pending or running job per key (enqueue(..., key=...)). A partial unique
-- index, so finished jobs keep their key for inspection and a key can be used again once its job
-- has finished. NULL keys (most jobs) are not indexed.
ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS key text;
ALTER TABLE {schema}.jobs DROP CONSTRAINT IF EXISTS jobs_key_check;
ALTER TABLE {schema}.jobs ADD CONSTRAINT jobs_key_check CHECK (key IS NULL OR length(key) BETWEEN 1 AND 255);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_key_idx ON {schema}.jobs (key)
  WHERE key IS NOT NULL AND status IN ('pending', 'running');
