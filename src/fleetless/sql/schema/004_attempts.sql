-- Attempt history: one row per attempt that ended (done, retried, dead, released, expired,
-- cancelled), written by the same statement that writes the job's own outcome, so the history
-- can never disagree with the job. Deleted with its job. A released attempt is given back to the
-- job (its number is used again by the next claim), so the key is a serial, not (job, attempt).
CREATE TABLE IF NOT EXISTS {schema}.job_attempts (
  id           bigserial   PRIMARY KEY,
  job_id       bigint      NOT NULL REFERENCES {schema}.jobs (id) ON DELETE CASCADE,
  attempt      int         NOT NULL,
  outcome      text        NOT NULL,
  host         text,                    -- the drainer's host name and pid (NULL: reaped, unknown)
  pid          int,
  tier         text,                    -- the sandbox tier it ran in
  started_at   timestamptz,             -- the claim
  finished_at  timestamptz NOT NULL DEFAULT now(),
  exit_code    int,                     -- the handler's exit status; NULL when killed or not run
  signal       text,                    -- the signal that ended it (SIGSEGV), if one did
  kill_reason  text,                    -- the sandbox's or drainer's reason for killing it
  duration_seconds float8,              -- finished_at - started_at
  error_head   text,                    -- the first 500 characters of last_error
  CONSTRAINT job_attempts_outcome_check
    CHECK (outcome IN ('done', 'retry', 'dead', 'released', 'expired', 'cancelled'))
);

CREATE INDEX IF NOT EXISTS job_attempts_job_idx ON {schema}.job_attempts (job_id, id);
