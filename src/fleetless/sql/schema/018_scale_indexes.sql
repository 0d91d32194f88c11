-- Claims and reads that stay cheap beside a large backlog (issue 26: 0.21-0.29 s to claim from, or
-- find the next due job of, a queue with nothing due beside 1M pending jobs of another queue,
-- because no index led with queue).
-- A drain of named queues claims in (priority, due time) order within them: this index reads only
-- their pending rows, in claim order.
CREATE INDEX IF NOT EXISTS jobs_queue_claim_idx ON {schema}.jobs (queue, priority DESC, run_after)
  WHERE status = 'pending';
-- The next pending job of a queue (watch mode's next_due, the oldest due job per queue in
-- /metrics and the dashboard): the first row of the queue's part of this index.
CREATE INDEX IF NOT EXISTS jobs_queue_due_idx ON {schema}.jobs (queue, run_after)
  WHERE status = 'pending';
-- Retention deletes finished jobs older than their status' age: one range of this index per
-- status, oldest first, so a pass reads only the rows it deletes (jobs_finished_idx, by finished_at
-- alone, made it filter every finished row younger than the dead jobs' age: 5M of them at scale).
CREATE INDEX IF NOT EXISTS jobs_finished_status_idx ON {schema}.jobs (status, finished_at)
  WHERE status IN ('done', 'cancelled', 'dead');
DROP INDEX IF EXISTS {schema}.jobs_finished_idx;
-- When a periodic maintenance task last ran in this database (retention: at most once a minute,
-- whichever drain comes first; the others skip it without waiting).
CREATE TABLE IF NOT EXISTS {schema}.maintenance_runs (
  name   text        PRIMARY KEY,
  last_at timestamptz NOT NULL
);
-- job_counts' triggers (016) return at once when their statement changed no row (an empty drain's
-- claim and reap): PL/pgSQL then plans only that test in a new session, not the INSERT (measured
-- here: 1.4 ms instead of ~10 ms for a session's first such statement). The update's net change
-- is summed over the old and new rows without joining them (a lease renewed, a cancel marked: the
-- same key minus one and plus one, which HAVING drops).
CREATE OR REPLACE FUNCTION {schema}.job_counts_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NOT EXISTS (SELECT FROM new_jobs) THEN RETURN NULL; END IF;
  INSERT INTO {schema}.job_counts (queue, kind, status, n)
  SELECT queue, kind, status, count(*) FROM new_jobs GROUP BY queue, kind, status;
  RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION {schema}.job_counts_updated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NOT EXISTS (SELECT FROM new_jobs) THEN RETURN NULL; END IF;
  INSERT INTO {schema}.job_counts (queue, kind, status, n)
  SELECT queue, kind, status, sum(n) FROM (
    SELECT queue, kind, status, -1 AS n FROM old_jobs
    UNION ALL
    SELECT queue, kind, status, 1 FROM new_jobs
  ) AS d
  GROUP BY queue, kind, status HAVING sum(n) <> 0;
  RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION {schema}.job_counts_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NOT EXISTS (SELECT FROM old_jobs) THEN RETURN NULL; END IF;
  INSERT INTO {schema}.job_counts (queue, kind, status, n)
  SELECT queue, kind, status, -count(*) FROM old_jobs GROUP BY queue, kind, status;
  RETURN NULL;
END $$;
