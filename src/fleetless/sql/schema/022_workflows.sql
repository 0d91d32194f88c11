-- Workflows (issue 29): a job may wait for other jobs, its parents, to end first.
-- A job enqueued after parents is 'waiting' until every parent is satisfied (done; or, for a child
-- with on_parent_failure = 'run', also dead or cancelled). 'waiting' lies outside the claim's
-- partial indexes (WHERE status = 'pending'), so the claim reads exactly what it read before.
-- parents_left counts the parents not yet satisfied; the finish that satisfies the last one makes
-- the child 'pending' (jobs_follow_parents below).
ALTER TABLE {schema}.jobs DROP CONSTRAINT IF EXISTS jobs_status_check;
ALTER TABLE {schema}.jobs ADD CONSTRAINT jobs_status_check
  CHECK (status IN ('pending', 'running', 'done', 'dead', 'cancelled', 'waiting')) NOT VALID;
ALTER TABLE {schema}.jobs VALIDATE CONSTRAINT jobs_status_check;
ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS parents_left int NOT NULL DEFAULT 0;
-- NULL for a job without parents; else what a parent ending dead or cancelled does to it.
ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS on_parent_failure text;
ALTER TABLE {schema}.jobs DROP CONSTRAINT IF EXISTS jobs_on_parent_failure_check;
ALTER TABLE {schema}.jobs ADD CONSTRAINT jobs_on_parent_failure_check
  CHECK (on_parent_failure IS NULL OR on_parent_failure IN ('cancel', 'run'));

-- One row per edge. Parents exist before their children (an enqueue names existing jobs, or
-- earlier items of its own enqueue_many), so no cycle can be made. No foreign keys (their checks
-- ran per row, as job_attempts' did: 014): the statements that delete jobs delete their edges.
-- By parent: a finish finds the children of the jobs it ended; by child: show, retry, _parents.
CREATE TABLE IF NOT EXISTS {schema}.job_dependencies (
  parent_id bigint NOT NULL,
  child_id  bigint NOT NULL,
  PRIMARY KEY (parent_id, child_id)
);
CREATE INDEX IF NOT EXISTS job_dependencies_child_idx ON {schema}.job_dependencies (child_id);

-- What a child reads of its parents: payload["_parents"], an object from each parent's id (as
-- text) to its result (result_json, else the stdout text), in id order while the results so far
-- add up to at most 256 KiB; past that a parent's entry is null and "_parents_cut" is true.
CREATE OR REPLACE FUNCTION {schema}.with_parent_results(payload jsonb, parents bigint[])
RETURNS jsonb LANGUAGE sql STABLE AS $$
  SELECT CASE WHEN jsonb_typeof(payload) <> 'object' THEN payload ELSE
    payload || jsonb_build_object(
      '_parents', COALESCE(jsonb_object_agg(r.id::text, CASE WHEN r.used <= 262144 THEN r.value END), '{}'::jsonb))
      || CASE WHEN max(r.used) > 262144 THEN jsonb_build_object('_parents_cut', true) ELSE '{}'::jsonb END
  END
  FROM (SELECT p.id, COALESCE(p.result_json, to_jsonb(p.result)) AS value,
               sum(COALESCE(octet_length(p.result_json::text), octet_length(p.result), 0))
                 OVER (ORDER BY p.id) AS used
        FROM {schema}.jobs p WHERE p.id = ANY(parents)) AS r
$$;

-- The finish's half of workflows, as a statement-level trigger so that every statement that ends
-- a job (the drain's finish in all its forms, the reaper, cancel, retry, an operator's own SQL)
-- moves its children in the same transaction. A statement that changed no row's status to or from
-- an end (a claim: every row 'running'), or a database with no edge at all, returns after a probe.
-- For the jobs this statement ended (or revived, by a retry) that have children:
--   done                       -> each waiting child: one parent fewer left;
--   dead / cancelled           -> a waiting child with on_parent_failure 'run': the same;
--                                 one with 'cancel': cancelled, with every waiting descendant
--                                 that would be cancelled by that in turn (reason in last_error);
--   dead / cancelled -> again  -> a waiting 'run' child had counted it as satisfied: one more left.
-- A child reaching 0 becomes 'pending' with its parents' results in its payload, and its queue is
-- NOTIFYed as an enqueue does, so a watching drainer takes it at once.
-- The children are locked first, in id order, by a statement of their own: drainers finishing
-- parents of overlapping children take the locks in the same order (no deadlock), and the update
-- that follows reads with a snapshot taken once it holds them, so it sees every parent finish
-- committed before it (each decrement of a child is serialised on the child's row: a fan-in is
-- released once, by the finish of its last parent, however many drainers race).
CREATE OR REPLACE FUNCTION {schema}.jobs_follow_parents() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  done_ids bigint[];
  failed_ids bigint[];
  revived_ids bigint[];
  child_ids bigint[];
  steps int[];
  steps_unrevived int[];
  fails bool[];
  doomed_ids bigint[];
  causes bigint[];
  n bigint;
BEGIN
  IF NOT EXISTS (SELECT FROM new_jobs WHERE status <> 'running') THEN RETURN NULL; END IF;
  IF NOT EXISTS (SELECT FROM {schema}.job_dependencies) THEN RETURN NULL; END IF;
  SELECT array_agg(j.id) FILTER (WHERE j.status = 'done'),
         array_agg(j.id) FILTER (WHERE j.status IN ('dead', 'cancelled') AND o.status NOT IN ('dead', 'cancelled')),
         array_agg(j.id) FILTER (WHERE o.status IN ('dead', 'cancelled')
                                   AND j.status NOT IN ('done', 'dead', 'cancelled'))
    INTO done_ids, failed_ids, revived_ids
  FROM (SELECT * FROM new_jobs WHERE status <> 'running') AS j
  JOIN old_jobs o ON o.id = j.id
  WHERE j.status <> o.status
    AND (j.status IN ('done', 'dead', 'cancelled') OR o.status IN ('dead', 'cancelled'))
    AND EXISTS (SELECT FROM {schema}.job_dependencies d WHERE d.parent_id = j.id);
  IF done_ids IS NULL AND failed_ids IS NULL AND revived_ids IS NULL THEN RETURN NULL; END IF;

  -- Release: the net change of each child's parents_left. A revived parent counts only for a
  -- 'run' child (a waiting 'cancel' child with a revived parent is one retry_children is reviving
  -- too, which counts its parents itself).
  SELECT array_agg(x.child_id ORDER BY x.child_id), array_agg(x.step ORDER BY x.child_id),
         array_agg(x.step_unrevived ORDER BY x.child_id), array_agg(x.failed ORDER BY x.child_id)
    INTO child_ids, steps, steps_unrevived, fails
  FROM (SELECT d.child_id, sum(m.step)::int AS step, COALESCE(sum(m.step) FILTER (WHERE m.step < 0), 0)::int
                 AS step_unrevived, bool_or(m.failed) AS failed
        FROM (SELECT unnest(done_ids) AS id, -1 AS step, false AS failed
              UNION ALL SELECT unnest(failed_ids), -1, true
              UNION ALL SELECT unnest(revived_ids), 1, false) AS m
        JOIN {schema}.job_dependencies d ON d.parent_id = m.id
        GROUP BY d.child_id) AS x;
  IF child_ids IS NOT NULL THEN
    PERFORM FROM {schema}.jobs c
    WHERE c.id = ANY(child_ids) AND c.status = 'waiting'
    ORDER BY c.id FOR UPDATE;
    WITH moved AS (
      UPDATE {schema}.jobs AS c
      SET parents_left = c.parents_left + x.step,
          status = CASE WHEN c.parents_left + x.step <= 0 THEN 'pending' ELSE 'waiting' END,
          payload = CASE WHEN c.parents_left + x.step <= 0
                         THEN {schema}.with_parent_results(c.payload, ARRAY(
                                SELECT d.parent_id FROM {schema}.job_dependencies d WHERE d.child_id = c.id))
                         ELSE c.payload END
      FROM (SELECT u.id, u.failed, CASE WHEN k.on_parent_failure = 'run' THEN u.step ELSE u.unrevived END AS step
            FROM unnest(child_ids, steps, steps_unrevived, fails) AS u(id, step, unrevived, failed)
            JOIN {schema}.jobs k ON k.id = u.id) AS x
      WHERE c.id = x.id AND c.status = 'waiting' AND (NOT x.failed OR c.on_parent_failure = 'run') AND x.step <> 0
      RETURNING c.status, c.queue
    )
    SELECT count(pg_notify('fleetless_' || TG_TABLE_SCHEMA, q.queue)) INTO n
    FROM (SELECT DISTINCT queue FROM moved WHERE status = 'pending') AS q;
  END IF;

  -- Failure: the waiting children (with on_parent_failure 'cancel') of the jobs that failed, and
  -- theirs in turn, each with the parent that doomed it (one row per edge, so linear in the graph).
  IF failed_ids IS NOT NULL THEN
    WITH RECURSIVE doomed(id, cause) AS (
      SELECT d.child_id, d.parent_id
      FROM {schema}.job_dependencies d JOIN {schema}.jobs c ON c.id = d.child_id
      WHERE d.parent_id = ANY(failed_ids) AND c.status = 'waiting' AND c.on_parent_failure = 'cancel'
      UNION
      SELECT d.child_id, d.parent_id
      FROM doomed x JOIN {schema}.job_dependencies d ON d.parent_id = x.id
      JOIN {schema}.jobs c ON c.id = d.child_id
      WHERE c.status = 'waiting' AND c.on_parent_failure = 'cancel'
    )
    SELECT array_agg(f.id ORDER BY f.id), array_agg(f.cause ORDER BY f.id) INTO doomed_ids, causes
    FROM (SELECT DISTINCT ON (id) id, cause FROM doomed ORDER BY id, cause) AS f;
    IF doomed_ids IS NOT NULL THEN
      PERFORM FROM {schema}.jobs c
      WHERE c.id = ANY(doomed_ids) AND c.status = 'waiting'
      ORDER BY c.id FOR UPDATE;
      UPDATE {schema}.jobs AS c
      SET status = 'cancelled', finished_at = now(),
          last_error = CASE WHEN x.cause = ANY(failed_ids)
                            THEN 'parent job ' || x.cause || ' ended ' || p.status
                            ELSE 'parent job ' || x.cause || ' was cancelled: one of its parents failed' END
                       || ' (on_parent_failure: cancel)'
      FROM unnest(doomed_ids, causes) AS x(id, cause) JOIN {schema}.jobs p ON p.id = x.cause
      WHERE c.id = x.id AND c.status = 'waiting';
    END IF;
  END IF;
  RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS jobs_follow_parents ON {schema}.jobs;
CREATE TRIGGER jobs_follow_parents AFTER UPDATE ON {schema}.jobs
  REFERENCING OLD TABLE AS old_jobs NEW TABLE AS new_jobs
  FOR EACH STATEMENT EXECUTE FUNCTION {schema}.jobs_follow_parents();
