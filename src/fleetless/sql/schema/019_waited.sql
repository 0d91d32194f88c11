-- Queue.wait / AsyncQueue.wait / `fleetless wait`: a waiter LISTENs on fleetless_<schema>_finished,
-- adds a job_waiters row for its job, and is woken when the job finishes, not by polling. A row
-- of its own rather than a flag on the job: an UPDATE of the job would lock it, and a drainer's
-- claim (SKIP LOCKED) would pass it over at that instant.
-- The NOTIFY comes from a statement-level trigger, so every statement that ends a job (the drain's
-- finish, the reaper, cancel, an operator's hand-written SQL) wakes its waiters in its own
-- transaction: a rolled-back finish wakes no one. With no waiter at all (the usual case) the
-- trigger costs one probe of an empty table; otherwise only waited jobs are named, at most 300
-- ids a NOTIFY, well under PostgreSQL's 8,000-byte payload limit. The finished jobs' waiter rows
-- go in the same statement (a waiter that died leaves none behind once its job ends).
CREATE TABLE IF NOT EXISTS {schema}.job_waiters (
  job_id bigint NOT NULL,
  since  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS job_waiters_job_idx ON {schema}.job_waiters (job_id);

CREATE OR REPLACE FUNCTION {schema}.jobs_finished_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM {schema}.job_waiters) THEN
    RETURN NULL;
  END IF;
  PERFORM pg_notify('fleetless_' || TG_TABLE_SCHEMA || '_finished', string_agg(id::text, ','))
  FROM (SELECT f.id, (row_number() OVER (ORDER BY f.id) - 1) / 300 AS part
        FROM (SELECT DISTINCT j.id
              FROM new_jobs j
              JOIN old_jobs o ON o.id = j.id
              JOIN {schema}.job_waiters w ON w.job_id = j.id
              WHERE j.status IN ('done', 'dead', 'cancelled') AND o.status <> j.status) AS f) AS p
  GROUP BY part;
  DELETE FROM {schema}.job_waiters w USING new_jobs j
  WHERE w.job_id = j.id AND j.status IN ('done', 'dead', 'cancelled');
  RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS jobs_finished_notify ON {schema}.jobs;
CREATE TRIGGER jobs_finished_notify AFTER UPDATE ON {schema}.jobs
  REFERENCING OLD TABLE AS old_jobs NEW TABLE AS new_jobs
  FOR EACH STATEMENT EXECUTE FUNCTION {schema}.jobs_finished_notify();
