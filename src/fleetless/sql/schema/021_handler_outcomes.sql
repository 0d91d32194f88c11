-- Handlers that decide their own outcome (fleetless.outcomes' Discard, Snooze, Retry; a script's
-- exit codes 90, 91, 92). A snooze gives its attempt back like a release, counted apart: a job may
-- snooze MAX_SNOOZES times (fleetless/outcomes.py), the next one is charged as a failed attempt.
ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS snoozes int NOT NULL DEFAULT 0;

-- The attempt history names the two new outcomes: 'discarded' (dead at once, by its handler) and
-- 'snoozed' (pending again, uncharged). NOT VALID: every row already there met the narrower
-- check, and a large history is not scanned under the table's lock; new rows are checked.
ALTER TABLE {schema}.job_attempts DROP CONSTRAINT IF EXISTS job_attempts_outcome_check;
ALTER TABLE {schema}.job_attempts ADD CONSTRAINT job_attempts_outcome_check
  CHECK (outcome IN ('done', 'retry', 'dead', 'released', 'expired', 'cancelled', 'discarded', 'snoozed'))
  NOT VALID;
