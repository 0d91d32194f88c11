-- The attempt history tells a plain failure from a handler's own Retry (issue 28: "record each"):
-- 'failed' is an attempt that failed (an error, a non-zero exit, a timeout) with attempts left;
-- 'retried' is one whose handler raised fleetless.outcomes.Retry (exit code 92) with attempts left.
-- Rows written before this migration, and by an older drainer during a rolling upgrade, say
-- 'retry' for both; every read maps 'retry' to 'failed' (queries.sql), so they stay readable and
-- are counted with the failures; none is rewritten (a large history is not updated in place).
-- NOT VALID, as in 021: the rows already there met the narrower check and are not scanned.
ALTER TABLE {schema}.job_attempts DROP CONSTRAINT IF EXISTS job_attempts_outcome_check;
ALTER TABLE {schema}.job_attempts ADD CONSTRAINT job_attempts_outcome_check
  CHECK (outcome IN ('done', 'retry', 'failed', 'retried', 'dead', 'released', 'expired', 'cancelled', 'discarded',
                     'snoozed'))
  NOT VALID;

-- A snooze is not an attempt (its attempt is given back, the next run has the same number): its
-- row carries the job's snooze count after it (1 for the first snooze), so the history reads
-- "attempt 1, snooze 2" instead of the same attempt repeated. NULL on every other row, and on
-- snooze rows written before this migration.
ALTER TABLE {schema}.job_attempts ADD COLUMN IF NOT EXISTS snooze int;
