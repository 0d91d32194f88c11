-- Every query fleetless runs, by name. {schema} is the quoted schema name; %(x)s are parameters.
-- Each block starts with "-- name: <name>"; the comment lines under it say why it is written so.

-- name: enqueue
-- One job. run_after: an explicit time wins, else now() + delay (0 when not given).
-- The NOTIFY (payload: the job's queue) is part of the same statement and so of the enqueuing
-- transaction: watchers wake at its commit, and a rolled-back enqueue wakes no one. The queue's
-- own connection prepares this statement when no pooler is in between (db.prepare_on_request).
-- max_attempts_default: the caller gave no max_attempts; each claim applies the kind's.
INSERT INTO {schema}.jobs (kind, payload, max_attempts, run_after, queue, priority, timeout_seconds,
                           max_attempts_default)
VALUES (%(kind)s, %(payload)s, %(max_attempts)s,
        COALESCE(%(run_after)s, now() + make_interval(secs => %(delay)s)),
        %(queue)s, %(priority)s, %(timeout)s, %(max_attempts_default)s)
RETURNING id, pg_notify(%(channel)s, queue);

-- name: enqueue_default
-- One job with every option at its default (the common call, enqueue(kind, payload)): the enqueue
-- statement's row from three parameters and the columns' defaults instead of nine parameters,
-- each of which psycopg adapts on every call (a fifth of an enqueue's client time).
-- test_queue.py checks that it writes what the enqueue statement writes.
INSERT INTO {schema}.jobs (kind, payload, max_attempts_default)
VALUES (%(kind)s, %(payload)s, true)
RETURNING id, pg_notify(%(channel)s, queue);

-- name: enqueue_keyed
-- One job with a key: at most one pending, running or waiting job per key (the partial unique
-- index jobs_live_key_idx, migration 027), decided by the index itself, so concurrent enqueues of a
-- key on any number of connections make exactly one job. On a duplicate: with replace, a still
-- pending job takes the new payload and options (a running one is left alone); otherwise nothing
-- is written. Either way the existing job's id is returned with inserted = false (and replaced =
-- true when it took the new payload). A replace keeps the job's due time unless this enqueue gave
-- one (keep_due: neither run_after nor delay given), so re-enqueueing a debounced job does not make
-- it due at once. A job with parents (a workflow's) is never replaced by this enqueue, which has
-- none: same_shape = false says so, and the caller refuses the replace (replace never rewires a
-- graph: enqueue_keyed_waiting).
-- When the duplicate was committed by another
-- transaction after this statement's snapshot, the fallback SELECT cannot see it and no row comes
-- back: the caller runs the statement again (a new snapshot under READ COMMITTED).
-- xmax = 0 tells a freshly inserted row from one updated by DO UPDATE.
WITH job AS (
  INSERT INTO {schema}.jobs AS j (kind, payload, max_attempts, run_after, queue, priority,
                                  timeout_seconds, key, max_attempts_default)
  VALUES (%(kind)s, %(payload)s, %(max_attempts)s,
          COALESCE(%(run_after)s, now() + make_interval(secs => %(delay)s)),
          %(queue)s, %(priority)s, %(timeout)s, %(key)s, %(max_attempts_default)s)
  ON CONFLICT (key) WHERE key IS NOT NULL AND status IN ('pending', 'running', 'waiting')
  DO UPDATE SET kind = EXCLUDED.kind, payload = EXCLUDED.payload, max_attempts = EXCLUDED.max_attempts,
                run_after = CASE WHEN %(keep_due)s THEN j.run_after ELSE EXCLUDED.run_after END,
                queue = EXCLUDED.queue, priority = EXCLUDED.priority,
                timeout_seconds = EXCLUDED.timeout_seconds, max_attempts_default = EXCLUDED.max_attempts_default
    WHERE %(replace)s AND j.status = 'pending'
      AND NOT EXISTS (SELECT FROM {schema}.job_dependencies d WHERE d.child_id = j.id)
  RETURNING j.id, j.queue, (j.xmax = 0) AS inserted
), notified AS (
  SELECT id, inserted, pg_notify(%(channel)s, queue) FROM job
)
SELECT id, inserted, NOT inserted AS replaced, true AS same_shape FROM notified
UNION ALL
SELECT id, false, false, NOT EXISTS (SELECT FROM {schema}.job_dependencies d WHERE d.child_id = jobs.id)
FROM {schema}.jobs
WHERE key = %(key)s AND status IN ('pending', 'running', 'waiting') AND NOT EXISTS (SELECT 1 FROM job);

-- name: enqueue_keyed_waiting
-- enqueue(after=..., key=...): a workflow's child with a key, as enqueue_keyed is for a job
-- without parents (and after lock_parents_missing has locked its parents, as enqueue_waiting
-- does). A new child is written 'waiting' with its edges (edges: only for a row this statement
-- inserted), and settle_children decides its status. A child already holding the key (pending,
-- running or waiting: an enqueue retried after a lost reply to its commit finds it here) is
-- returned, inserted = false, whatever its parents. With replace, it takes the new payload and
-- options only if it is still pending or waiting and its shape in the graph is this enqueue's:
-- the same parents (after, sorted and distinct) and the same on_parent_failure; a pending one
-- gets its parents' results in the new payload again. Otherwise same_shape = false and the
-- caller refuses: a replace that rewired the graph could strand the job's children or its own
-- count of parents left (parents_left was counted for its parents). A waiting child's replace
-- keeps its status and parents_left. A pending child taking a replace NOTIFYs its queue.
WITH job AS (
  INSERT INTO {schema}.jobs AS j (kind, payload, max_attempts, run_after, queue, priority,
                                  timeout_seconds, key, max_attempts_default, status, on_parent_failure)
  VALUES (%(kind)s, %(payload)s, %(max_attempts)s,
          COALESCE(%(run_after)s, now() + make_interval(secs => %(delay)s)),
          %(queue)s, %(priority)s, %(timeout)s, %(key)s, %(max_attempts_default)s, 'waiting',
          %(on_parent_failure)s)
  ON CONFLICT (key) WHERE key IS NOT NULL AND status IN ('pending', 'running', 'waiting')
  DO UPDATE SET kind = EXCLUDED.kind,
                payload = CASE WHEN j.status = 'pending'
                               THEN {schema}.with_parent_results(EXCLUDED.payload, %(after)s::bigint[])
                               ELSE EXCLUDED.payload END,
                max_attempts = EXCLUDED.max_attempts,
                run_after = CASE WHEN %(keep_due)s THEN j.run_after ELSE EXCLUDED.run_after END,
                queue = EXCLUDED.queue, priority = EXCLUDED.priority,
                timeout_seconds = EXCLUDED.timeout_seconds, max_attempts_default = EXCLUDED.max_attempts_default
    WHERE %(replace)s AND j.status IN ('pending', 'waiting')
      AND j.on_parent_failure IS NOT DISTINCT FROM EXCLUDED.on_parent_failure
      AND ARRAY(SELECT d.parent_id FROM {schema}.job_dependencies d WHERE d.child_id = j.id
                ORDER BY d.parent_id) = %(after)s::bigint[]
  RETURNING j.id, j.queue, j.status, (j.xmax = 0) AS inserted
), edges AS (
  INSERT INTO {schema}.job_dependencies (parent_id, child_id)
  SELECT p, job.id FROM job, unnest(%(after)s::bigint[]) AS p WHERE job.inserted
), notified AS (
  SELECT count(pg_notify(%(channel)s, queue)) AS n FROM job WHERE status = 'pending'
)
SELECT id, inserted, NOT inserted AS replaced, true AS same_shape FROM job, notified
UNION ALL
SELECT id, false, false,
       on_parent_failure IS NOT DISTINCT FROM %(on_parent_failure)s
       AND ARRAY(SELECT d.parent_id FROM {schema}.job_dependencies d WHERE d.child_id = jobs.id
                 ORDER BY d.parent_id) = %(after)s::bigint[]
FROM {schema}.jobs
WHERE key = %(key)s AND status IN ('pending', 'running', 'waiting') AND NOT EXISTS (SELECT 1 FROM job);

-- name: enqueue_waiting
-- enqueue(after=...): the job, 'waiting' (outside the claim's indexes), and its edges, in one
-- statement; settle_children, in the same transaction, then decides its status. Nothing is
-- written (no row back) unless every parent exists. The parents are locked FOR KEY SHARE as they
-- are counted, so none can be deleted (an operator's delete, retention) until this commits: a
-- delete committed first is seen here (the parent is not counted: no job with that id), one after
-- waits (test_workflows.py::test_a_parent_deleted_while_a_child_is_enqueued_is_no_job).
WITH job AS (
  INSERT INTO {schema}.jobs (kind, payload, max_attempts, run_after, queue, priority, timeout_seconds,
                             max_attempts_default, status, on_parent_failure)
  SELECT %(kind)s, %(payload)s, %(max_attempts)s,
         COALESCE(%(run_after)s, now() + make_interval(secs => %(delay)s)),
         %(queue)s, %(priority)s, %(timeout)s, %(max_attempts_default)s, 'waiting', %(on_parent_failure)s
  WHERE (SELECT count(*) FROM (SELECT FROM {schema}.jobs WHERE id = ANY(%(after)s::bigint[])
                               ORDER BY id FOR KEY SHARE) AS p) = cardinality(%(after)s::bigint[])
  RETURNING id
), edges AS (
  INSERT INTO {schema}.job_dependencies (parent_id, child_id)
  SELECT p, job.id FROM job, unnest(%(after)s::bigint[]) AS p
)
SELECT id FROM job;

-- name: missing_jobs
-- Which of these ids name no job (an enqueue's parents that do not exist, to name them).
SELECT m.id FROM unnest(%(ids)s::bigint[]) AS m(id)
WHERE NOT EXISTS (SELECT FROM {schema}.jobs j WHERE j.id = m.id) ORDER BY m.id;

-- name: lock_parents_missing
-- enqueue_many's parents, locked FOR KEY SHARE (as enqueue_waiting does: none can be deleted until
-- the call commits): those that name no job (one deleted meanwhile included), to name them.
WITH locked AS (
  SELECT id FROM {schema}.jobs WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id FOR KEY SHARE
), found AS (SELECT COALESCE(array_agg(id), '{}') AS ids FROM locked)
SELECT m.id FROM unnest(%(ids)s::bigint[]) AS m(id), found WHERE m.id <> ALL(found.ids) ORDER BY m.id;

-- name: copy_waiting_jobs
-- enqueue_many's items with parents: written 'waiting' (never claimable as written), then settled.
COPY {schema}.jobs (id, kind, payload, max_attempts, run_after, queue, priority, timeout_seconds,
                    max_attempts_default, status, on_parent_failure)
FROM STDIN;

-- name: copy_dependencies
COPY {schema}.job_dependencies (parent_id, child_id) FROM STDIN;

-- name: settle_children
-- The enqueue's half of workflows, last in the enqueuing transaction: each new waiting child's
-- parents are locked (FOR SHARE, in id order) so that none of them can end meanwhile: a parent
-- whose finish committed first is seen ended here (its finish did not see this child's
-- uncommitted edge), and a parent that ends after this commits finds the edge (its finish waited
-- for the lock). The child then counts its unsatisfied parents: none left, it is 'pending' now
-- with its parents' results in its payload (and its queue NOTIFYed); a parent already dead or
-- cancelled and on_parent_failure 'cancel', it is 'cancelled' at once with the reason; else it
-- stays 'waiting' with parents_left set. A child whose parents are other new children of the same
-- enqueue_many counts them as not done (they are not). A parent that no longer exists is not done
-- either (the enqueue locked its parents against a delete: none should be missing). Returns each
-- child's status.
WITH locked AS (
  SELECT p.id, p.status FROM {schema}.jobs p
  WHERE p.id IN (SELECT d.parent_id FROM {schema}.job_dependencies d WHERE d.child_id = ANY(%(ids)s::bigint[]))
  ORDER BY p.id FOR SHARE
), tally AS (
  SELECT c.id,
         count(d.parent_id) FILTER (WHERE l.id IS NULL OR (l.status <> 'done'
                               AND NOT (c.on_parent_failure = 'run' AND l.status IN ('dead', 'cancelled'))))
           AS left_,
         min(l.id) FILTER (WHERE l.status IN ('dead', 'cancelled')) AS failed,
         array_agg(l.id) FILTER (WHERE l.id IS NOT NULL) AS parents
  FROM {schema}.jobs c
  LEFT JOIN {schema}.job_dependencies d ON d.child_id = c.id
  LEFT JOIN locked l ON l.id = d.parent_id
  WHERE c.id = ANY(%(ids)s::bigint[]) AND c.status = 'waiting'
  GROUP BY c.id
), settled AS (
  UPDATE {schema}.jobs AS c
  SET status = CASE WHEN t.failed IS NOT NULL AND c.on_parent_failure = 'cancel' THEN 'cancelled'
                    WHEN t.left_ > 0 THEN 'waiting' ELSE 'pending' END,
      parents_left = t.left_,
      finished_at = CASE WHEN t.failed IS NOT NULL AND c.on_parent_failure = 'cancel' THEN now() END,
      last_error = CASE WHEN t.failed IS NOT NULL AND c.on_parent_failure = 'cancel'
                        THEN 'parent job ' || t.failed || ' had ended '
                             || (SELECT l.status FROM locked l WHERE l.id = t.failed)
                             || ' before this job was enqueued (on_parent_failure: cancel)' END,
      payload = CASE WHEN t.left_ = 0 AND NOT (t.failed IS NOT NULL AND c.on_parent_failure = 'cancel')
                     THEN {schema}.with_parent_results(c.payload, t.parents) ELSE c.payload END
  FROM tally t
  WHERE c.id = t.id
  RETURNING c.id, c.status, c.queue
), notified AS (
  SELECT count(pg_notify(%(channel)s, q.queue)) AS n
  FROM (SELECT DISTINCT queue FROM settled WHERE status = 'pending') AS q
)
SELECT s.id, s.status FROM settled s, notified;

-- name: graph_labels_peek
-- An enqueue's parents' graph labels, read without a lock (NULL: in no graph yet), only to tell
-- whether the call joins two or more graphs and which graph_joins slots it must lock first
-- (fleetless.graphs.Labels.join_slots); graph_labels reads them again under its lock.
SELECT id, graph_id FROM {schema}.jobs WHERE id = ANY(%(ids)s::bigint[]);

-- name: graph_join_lock
-- An enqueue that joins graphs: the slots of every graph it joins (migration 029), locked in
-- slot order before any job of those graphs is locked, so joins of a common graph take turns
-- (two at once held share locks on jobs the other relabelled: a deadlock).
SELECT slot FROM {schema}.graph_joins WHERE slot = ANY(%(slots)s::int[]) ORDER BY slot FOR UPDATE;

-- name: graph_label_fresh
-- The graph labels (jobs.graph_id, migration 028) of an enqueue's parents written before this
-- call that are in no graph yet: each becomes a graph of its own (its own id), before any of them
-- is locked FOR SHARE (graph_labels). Two enqueues of children of one fresh parent take turns
-- here (the second then finds it labelled and writes nothing); labelling it later, under the
-- share lock both hold, would deadlock them.
UPDATE {schema}.jobs SET graph_id = id WHERE id = ANY(%(ids)s::bigint[]) AND graph_id IS NULL;

-- name: graph_labels
-- Those parents' graph labels, locked FOR SHARE (in id order, as settle_children locks them): no
-- relabel (graph_relabel, another enqueue's) can change them until this transaction ends, and one
-- that committed while this waited is read here (a locking read returns the newest version).
SELECT id, graph_id FROM {schema}.jobs WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id FOR SHARE;

-- name: graph_relabel
-- Existing graphs that a new child joins together become one: every job labelled old takes new
-- (the smaller). By the graph index. The caller runs it again until it changes no row: a child
-- another enqueue added to an old graph while this one waited for its lock on that enqueue's
-- parent committed after this statement's snapshot, and the next run (a new snapshot) sees it;
-- an enqueue that comes later waits for this transaction's row locks and reads the new label.
-- The jobs are locked first in id order, as graph_labels and settle_children lock parents: an
-- enqueue of a child of two jobs of the graph (it joins nothing, so takes no graph_joins slot)
-- holding the first FOR SHARE while waiting for the second, which an UPDATE in its plan's order
-- had locked before reaching the first, deadlocked with it
-- (test_workflows.py::test_a_child_of_two_jobs_of_a_graph_and_a_join_of_that_graph_at_once_do_not_deadlock).
WITH locked AS (
  SELECT j.id, x.new FROM {schema}.jobs AS j
  JOIN unnest(%(old)s::bigint[], %(new)s::bigint[]) AS x(old, new) ON j.graph_id = x.old
  ORDER BY j.id FOR NO KEY UPDATE OF j
), moved AS (
  UPDATE {schema}.jobs AS j SET graph_id = l.new FROM locked l
  WHERE j.id = l.id
  RETURNING 1
)
SELECT count(*) AS n FROM moved;

-- name: graph_label_set
-- The jobs an enqueue wrote into graphs (its children, and its own jobs that are their parents)
-- take their graph's label, by primary key; rows of this transaction only.
UPDATE {schema}.jobs AS j SET graph_id = x.label
FROM unnest(%(ids)s::bigint[], %(labels)s::bigint[]) AS x(id, label)
WHERE j.id = x.id AND j.graph_id IS DISTINCT FROM x.label;

-- name: job_parents
-- `fleetless show` and the dashboard's job page: a job's parents, by the edges' child index.
SELECT j.id, j.kind, j.status, j.finished_at FROM {schema}.job_dependencies d
JOIN {schema}.jobs j ON j.id = d.parent_id
WHERE d.child_id = %(id)s ORDER BY j.id LIMIT %(limit)s;

-- name: job_children
-- The same for its children, by the edges' primary key (parent first).
SELECT j.id, j.kind, j.status, j.finished_at FROM {schema}.job_dependencies d
JOIN {schema}.jobs j ON j.id = d.child_id
WHERE d.parent_id = %(id)s ORDER BY j.id LIMIT %(limit)s;

-- name: job_graph_counts
-- How many parents and children a job has, and its children by status (the graph's state).
SELECT (SELECT count(*) FROM {schema}.job_dependencies WHERE child_id = %(id)s) AS parents,
       (SELECT count(*) FROM {schema}.job_dependencies WHERE parent_id = %(id)s) AS children,
       (SELECT COALESCE(jsonb_object_agg(status, n), '{}'::jsonb) FROM (
          SELECT j.status, count(*) AS n FROM {schema}.job_dependencies d
          JOIN {schema}.jobs j ON j.id = d.child_id WHERE d.parent_id = %(id)s GROUP BY j.status) AS s)
         AS children_by_status;

-- name: schema_version
-- The newest migration applied to this schema: a drain compares it with its own newest before it
-- claims, so an old schema is "run 'fleetless init'", not a missing column in the middle of a drain.
SELECT COALESCE(max(version), 0) AS version FROM {schema}.migrations;

-- name: notify
-- enqueue_many's NOTIFYs, after its COPY, in its transaction (each payload: queues, comma-separated).
-- A payload must stay under 8,000 bytes, so many queues go out as several payloads
-- (queue.notify_payloads), all in this one statement.
SELECT count(pg_notify(%(channel)s, payload)) FROM unnest(%(payloads)s::text[]) AS payload;

-- name: migration_lock_wait
-- init: bound its wait for another init's lock on the migrations table (this transaction only;
-- `old` is what to put back after, for a caller's own transaction).
SELECT current_setting('lock_timeout') AS old, set_config('lock_timeout', %(timeout)s, true);

-- name: migration_lock_unwait
-- init: lock_timeout back to what it was (migration_lock_wait).
SELECT set_config('lock_timeout', %(old)s, true);

-- name: server_encoding
-- init refuses a database whose text is not UTF-8: under LATIN1 a job's non-Latin-1 output
-- cannot be stored, and under SQL_ASCII text comes back as bytes.
SELECT current_setting('server_encoding');

-- name: open_transaction
-- db.atomic: starts the caller's implicit transaction, so that the block after it is a savepoint
-- inside it rather than a transaction psycopg would commit on its own.
SELECT 1;

-- name: enqueue_rows
-- AsyncQueue.enqueue_many: many unkeyed jobs in one statement from one array per column (in item
-- order), for drivers without psycopg's COPY (asyncpg) and to stay one round trip on either. Ids
-- come from the sequence as the rows are inserted in ordinality order, so sorted ids follow the
-- items. run_after: an explicit time wins, else now() + delay, as in enqueue.
INSERT INTO {schema}.jobs (kind, payload, max_attempts, run_after, queue, priority, timeout_seconds,
                           max_attempts_default)
SELECT t.kind, t.payload, t.max_attempts, COALESCE(t.run_after, now() + make_interval(secs => t.delay)),
       t.queue, t.priority, t.timeout, t.dflt
FROM unnest(%(kinds)s::text[], %(payloads)s::jsonb[], %(max_attempts)s::int[], %(run_afters)s::timestamptz[],
            %(delays)s::float8[], %(queues)s::text[], %(priorities)s::int[], %(timeouts)s::int[],
            %(defaults)s::bool[]) WITH ORDINALITY
     AS t(kind, payload, max_attempts, run_after, delay, queue, priority, timeout, dflt, n)
ORDER BY t.n
RETURNING id;

-- name: reserve_ids
-- enqueue_many: COPY cannot return ids, so take them from the sequence first and COPY them in
-- (one chunk of jobs at a time, so that a million jobs stream instead of sitting in memory).
-- now() is the transaction's start, the same clock the column default would use.
SELECT now() AS now, array_agg(nextval(pg_get_serial_sequence(%(table)s, 'id'))) AS ids
FROM generate_series(1, %(n)s);

-- name: copy_jobs
COPY {schema}.jobs (id, kind, payload, max_attempts, run_after, queue, priority, timeout_seconds,
                    max_attempts_default)
FROM STDIN;

-- name: copy_default_jobs
-- enqueue_many's jobs with every option at its default, as enqueue_default: four columns per row
-- (max_attempts_default is true: the claim applies the kind's), the rest the columns' defaults
-- (run_after's now() is reserve_ids' now, the same transaction); COPY and psycopg's adaptation
-- spent twice as long per row on the nine.
COPY {schema}.jobs (id, kind, payload, max_attempts_default) FROM STDIN;

-- name: claim
-- The seed's claim: one statement marks a batch running and returns it, so a crash between claim
-- and execution leaves rows visibly claimed (and reapable) rather than silently lost.
-- skip_kinds: kinds this drain found it cannot run (a handler's interpreter is missing in its
-- sandbox); left pending for a drain that can, never charged an attempt.
-- SKIP LOCKED lets any number of drainers on any number of hosts take distinct rows without
-- waiting on each other. Every claim sets a fresh claim_token, made by the drainer for this one
-- statement: all later writes for this run of the job are fenced on it (id and token), and when
-- the reply to a committed claim is lost the drainer finds its rows again by it (claimed_with).
-- The lease covers the job's timeout (bounded by the sandbox TTL) plus a grace period; the reaper
-- returns the claim once it has passed.
-- kinds (fleetless.toml, as JSON; NULL when the file sets nothing): a kind's tier is recorded on
-- its rows, and a job enqueued without its own max_attempts takes its kind's, else the default 3
-- (never below the attempt it is starting). Kinds with a concurrency or rate limit are in skip_kinds here: they are
-- claimed by claim_limited, so this stays one statement for a drain without limits.
-- Queues that are paused or have a concurrency (queue_settings) are left out here: a paused one is
-- not claimed at all, a limited one by claim_queue_limited under its row lock. The list is an
-- InitPlan read once per statement, always current (a pause holds from the next claim on). It is
-- written "(CASE WHEN queue = ANY(gated) THEN NULL ELSE 1 END) IS NOT NULL", not "queue <> ALL(gated)":
-- the planner estimates the latter from the queue column's few distinct values as keeping almost
-- no row and chose a bitmap scan and a sort of a kind's whole backlog over the claim index; the
-- former it estimates as keeping nearly every row (0.995), so the plan is the one without it
-- (test_query_plans.py::test_the_queue_gate_leaves_the_claims_plan_as_it_was). Every gate below reads so.
UPDATE {schema}.jobs AS j
SET status = 'running',
    attempts = j.attempts + 1,
    claim_token = %(token)s,
    locked_at = now(),
    started_at = now(),
    finished_at = NULL,
    claimed_by = %(claimed_by)s,
    tier = COALESCE(%(kinds)s::jsonb -> j.kind ->> 'tier', %(tier)s),
    max_attempts = CASE WHEN j.max_attempts_default
                        THEN GREATEST(COALESCE((%(kinds)s::jsonb -> j.kind ->> 'max_attempts')::int, 3),
                                      j.attempts + 1)
                        ELSE j.max_attempts END,
    lease_expires_at = now() + make_interval(
        secs => LEAST(COALESCE(j.timeout_seconds, %(default_timeout)s::float8), %(ttl)s::float8) + %(grace)s::float8)
-- The ids as one array (an InitPlan run once), not IN (subquery): the planner then reaches each
-- row by its primary key instead of hashing a scan of the whole table (a 2,000-row claim: 0.8x).
-- Without skip_kinds: the first array, the first n due rows in claim order. With them: the second
-- (each is gated on skip_kinds, so only one reads anything). Filtering the claim order by kind
-- read every due row of the skipped kinds first (0.6-1.06 s beside 1M pending of limited kinds,
-- issue 26); instead each (kind, queue) with pending jobs is found by a skip scan of
-- jobs_kind_claim_idx (migration 020, one index descent per pair), and of the pairs the drain may
-- take, each one's first n due rows in claim order (its part of that index, locked as read, so a
-- concurrent claim's rows are passed over as above); of those, the first n in claim order.
WHERE j.id = ANY(ARRAY(
  (SELECT id FROM {schema}.jobs
   WHERE status = 'pending' AND run_after <= now() AND %(skip_kinds)s::text[] IS NULL
     AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
     AND (CASE WHEN queue = ANY(ARRAY(SELECT queue FROM {schema}.queue_settings WHERE paused OR concurrency IS NOT NULL))
               THEN NULL ELSE 1 END) IS NOT NULL
   ORDER BY priority DESC, run_after
   FOR UPDATE SKIP LOCKED
   LIMIT %(n)s)
) || ARRAY(
  (WITH RECURSIVE pair AS (
     (SELECT kind, queue FROM {schema}.jobs
      WHERE status = 'pending' AND %(skip_kinds)s::text[] IS NOT NULL ORDER BY kind, queue LIMIT 1)
     UNION ALL
     SELECT nx.kind, nx.queue FROM pair p CROSS JOIN LATERAL (
       SELECT kind, queue FROM {schema}.jobs
       WHERE status = 'pending' AND (kind, queue) > (p.kind, p.queue) ORDER BY kind, queue LIMIT 1) AS nx
   )
   SELECT c.id FROM pair p CROSS JOIN LATERAL (
     SELECT id, priority, run_after FROM {schema}.jobs
     WHERE status = 'pending' AND kind = p.kind AND queue = p.queue AND run_after <= now()
     ORDER BY priority DESC, run_after
     FOR UPDATE SKIP LOCKED
     LIMIT %(n)s) AS c
   WHERE p.kind <> ALL(%(skip_kinds)s::text[])
     AND (%(queues)s::text[] IS NULL OR p.queue = ANY(%(queues)s::text[]))
     AND (CASE WHEN p.queue = ANY(ARRAY(SELECT queue FROM {schema}.queue_settings WHERE paused OR concurrency IS NOT NULL))
               THEN NULL ELSE 1 END) IS NOT NULL
   ORDER BY c.priority DESC, c.run_after
   LIMIT %(n)s)
))
RETURNING j.id, j.kind, j.payload::text AS payload_json, j.attempts, j.max_attempts, j.claim_token,
          j.timeout_seconds, j.queue, j.priority,
          extract(epoch FROM j.lease_expires_at - now())::float8 AS lease_seconds, j.snoozes, j.releases;

-- name: claimed_with
-- The rows one claim statement took, found by its token: the reply to a committed claim was lost
-- (connection dropped) and the drainer retries. The payload travels as text: the drainer hands it
-- to the sandbox as it is and never has to parse it (a payload another producer nested 2,000
-- levels deep cannot crash a drain).
SELECT j.id, j.kind, j.payload::text AS payload_json, j.attempts, j.max_attempts, j.claim_token,
       j.timeout_seconds, j.queue, j.priority,
       extract(epoch FROM j.lease_expires_at - now())::float8 AS lease_seconds, j.snoozes, j.releases
FROM {schema}.jobs AS j
WHERE j.status = 'running' AND j.claim_token = %(token)s;

-- name: outcomes_of
-- After a fenced finish did not match some of its claims (or wrote two claims of one job in one
-- statement): which of them did this drainer's own earlier try write, its reply lost and the call
-- retried? Every finish writes its claim's token into the attempt's history row in the same
-- statement, so a history row of (job, token) is that claim's outcome, written: also once the job
-- has been claimed again and holds another token (a snooze or retry due at once, taken by the
-- next claim before the finish was retried), which the job's own row can no longer tell. The
-- status is the one that write set. No such row: fenced out (a reap writes no token). Outcomes are
-- told apart by claim, never by job id alone. Through job_attempts_job_idx (a job's few rows).
SELECT a.job_id AS id, a.claim_token AS token,
       CASE a.outcome WHEN 'done' THEN 'done' WHEN 'cancelled' THEN 'cancelled'
                      WHEN 'dead' THEN 'dead' WHEN 'discarded' THEN 'dead' ELSE 'pending' END AS status
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS c(id, token)
JOIN {schema}.job_attempts AS a ON a.job_id = c.id AND a.claim_token = c.token
WHERE a.outcome <> 'expired';

-- name: complete
-- Fenced: matches only while this claim still holds the job. A drainer whose lease was reaped
-- (and the job claimed again by another) updates nothing here and learns it lost the job.
-- The attempt's history row is written by the same statement (a data-modifying CTE), so it
-- exists exactly when the outcome does; a fenced-out finish writes neither.
WITH finished AS (
  UPDATE {schema}.jobs
  SET status = 'done', result = %(result)s, last_error = NULL, finished_at = now(),
      locked_at = NULL, lease_expires_at = NULL
  WHERE id = %(id)s AND claim_token = %(token)s AND status = 'running'
  RETURNING id, attempts, started_at, status, tier
), history AS (
  INSERT INTO {schema}.job_attempts (job_id, attempt, outcome, host, pid, tier, started_at,
                                     exit_code, signal, kill_reason, duration_seconds, error_head, claim_token)
  SELECT id, attempts, 'done', %(host)s, %(pid)s, COALESCE(%(tier)s, tier), started_at, %(exit_code)s, %(signal)s,
         %(kill_reason)s, extract(epoch FROM now() - started_at), NULL, %(token)s
  FROM finished
)
SELECT status FROM finished;

-- name: fail
-- Fenced like complete. Failure with attempts left goes back to pending after a backoff delay
-- computed by the retry policy; exhausted (or permanent) failure is dead and stays for inspection.
-- The attempt's history row is written by the same statement, as in complete.
-- A job whose cancel was requested (cancel_requested_at, set by `fleetless cancel` while it ran)
-- never goes back to pending: what would have been a retry or a give-back ends it cancelled, and
-- its last_error leads with the cancel (the attempt's own end after it: a snooze's reason alone
-- would read as why it was cancelled); the history row keeps the attempt's own error.
WITH finished AS (
  UPDATE {schema}.jobs
  SET status = CASE WHEN cancel_requested_at IS NULL AND attempts < max_attempts AND NOT %(permanent)s
                     THEN 'pending' WHEN cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'dead' END,
      run_after = CASE WHEN cancel_requested_at IS NULL AND attempts < max_attempts AND NOT %(permanent)s
                       THEN now() + make_interval(secs => %(delay)s) ELSE run_after END,
      finished_at = CASE WHEN cancel_requested_at IS NULL AND attempts < max_attempts AND NOT %(permanent)s
                         THEN NULL ELSE now() END,
      last_error = CASE WHEN cancel_requested_at IS NULL OR %(error)s LIKE 'cancelled:%%' THEN %(error)s
                        ELSE 'cancelled: an operator cancelled the job while it ran; its attempt ended: ' || %(error)s END,
      result = %(result)s, locked_at = NULL, lease_expires_at = NULL, releases = 0
  WHERE id = %(id)s AND claim_token = %(token)s AND status = 'running'
  RETURNING id, attempts, started_at, status, tier
), history AS (
  INSERT INTO {schema}.job_attempts (job_id, attempt, outcome, host, pid, tier, started_at,
                                     exit_code, signal, kill_reason, duration_seconds, error_head, claim_token)
  SELECT id, attempts, CASE status WHEN 'pending' THEN 'failed' ELSE status END, %(host)s, %(pid)s,
         COALESCE(%(tier)s, tier), started_at, %(exit_code)s, %(signal)s, %(kill_reason)s,
         extract(epoch FROM now() - started_at), left(%(error)s, 500), %(token)s
  FROM finished
)
SELECT status FROM finished;

-- name: release
-- Give a claim back without charging the job an attempt: the drainer is shutting down or its
-- sandbox broke, which is not the job's fault. Fenced like complete; the history row keeps the
-- token (outcomes_of).
-- Bounded: the max_releases-th release in a row is charged as a failed attempt instead (pending
-- after the backoff delay, or dead when none is left), so a job that breaks its sandbox every
-- time cannot block a queue forever. The history row keeps the attempt's number and start as
-- they were before the give-back (read from "was").
-- A job whose cancel was requested (cancel_requested_at, set by `fleetless cancel` while it ran)
-- never goes back to pending: what would have been a retry or a give-back ends it cancelled, and
-- its last_error leads with the cancel (the attempt's own end after it: a snooze's reason alone
-- would read as why it was cancelled); the history row keeps the attempt's own error.
WITH finished AS (
  UPDATE {schema}.jobs AS j
  SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
                    WHEN j.releases + 1 < %(max_releases)s OR j.attempts < j.max_attempts THEN 'pending'
                    ELSE 'dead' END,
      attempts = CASE WHEN j.cancel_requested_at IS NULL AND j.releases + 1 < %(max_releases)s
                      THEN GREATEST(j.attempts - 1, 0) ELSE j.attempts END,
      run_after = CASE WHEN j.cancel_requested_at IS NULL AND j.releases + 1 >= %(max_releases)s
                       THEN now() + make_interval(secs => %(delay)s) ELSE j.run_after END,
      finished_at = CASE WHEN j.cancel_requested_at IS NOT NULL THEN now()
                         WHEN j.releases + 1 < %(max_releases)s OR j.attempts < j.max_attempts THEN NULL
                         ELSE now() END,
      last_error = CASE WHEN j.cancel_requested_at IS NOT NULL AND %(error)s NOT LIKE 'cancelled:%%'
                        THEN 'cancelled: an operator cancelled the job while it ran; its attempt ended: ' || %(error)s
                        WHEN j.cancel_requested_at IS NOT NULL OR j.releases + 1 < %(max_releases)s
                        THEN %(error)s
                        ELSE 'released ' || (j.releases + 1) || ' times in a row; charged as an attempt: '
                             || %(error)s END,
      releases = CASE WHEN j.releases + 1 < %(max_releases)s THEN j.releases + 1 ELSE 0 END,
      locked_at = NULL, lease_expires_at = NULL, started_at = NULL
  FROM (SELECT id, attempts, started_at FROM {schema}.jobs WHERE id = %(id)s) AS was
  WHERE j.id = was.id AND j.claim_token = %(token)s AND j.status = 'running'
  RETURNING j.id, was.attempts, was.started_at, j.status, j.tier, j.releases = 0 AS charged
), history AS (
  INSERT INTO {schema}.job_attempts (job_id, attempt, outcome, host, pid, tier, started_at,
                                     kill_reason, duration_seconds, error_head, claim_token)
  SELECT id, attempts,
         CASE WHEN status = 'cancelled' THEN 'cancelled' WHEN NOT charged THEN 'released'
              WHEN status = 'dead' THEN 'dead' ELSE 'failed' END,
         %(host)s, %(pid)s, COALESCE(%(tier)s, tier), started_at, %(kill_reason)s,
         extract(epoch FROM now() - started_at), left(%(error)s, 500), %(token)s
  FROM finished
)
SELECT status FROM finished;

-- name: reap
-- The reaper: claims whose drainer died sit in running forever unless returned. A lease that
-- expired (or, with older_than, a claim older than that, as in the seed) goes back to pending, or
-- to dead when no attempt is left. Clearing claim_token fences out the old drainer if it was only
-- slow, not dead. SKIP LOCKED: never wait on a row a live drainer is finishing right now.
-- Each reaped attempt gets its history row (outcome expired) in the same statement.
-- A job whose cancel was requested (cancel_requested_at, set by `fleetless cancel` while it ran)
-- never goes back to pending: what would have been a retry or a give-back ends it cancelled, and
-- its last_error leads with the cancel (the attempt's own end after it: a snooze's reason alone
-- would read as why it was cancelled); the history row keeps the attempt's own error.
WITH reaped AS (
UPDATE {schema}.jobs AS j
SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
                  WHEN j.attempts < j.max_attempts THEN 'pending' ELSE 'dead' END,
    finished_at = CASE WHEN j.cancel_requested_at IS NULL AND j.attempts < j.max_attempts
                       THEN NULL ELSE now() END,
    last_error = CASE WHEN j.cancel_requested_at IS NOT NULL
                      THEN 'cancelled: an operator cancelled the job while it ran; its attempt ended: ' ELSE '' END
                 || 'claim expired: the drainer did not finish attempt ' || j.attempts
                 || ' (claimed at ' || to_char(j.locked_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')
                 || ' UTC); presumed dead',
    locked_at = NULL, lease_expires_at = NULL, claim_token = NULL,
    releases = 0  -- the expired attempt was charged: a streak of give-backs ends here, as on a failure
WHERE j.id IN (
  SELECT id FROM {schema}.jobs
  WHERE status = 'running'
    AND CASE WHEN %(older_than)s::float8 IS NULL THEN lease_expires_at < now()
             ELSE locked_at < now() - make_interval(secs => %(older_than)s::float8) END
  FOR UPDATE SKIP LOCKED
)
RETURNING j.id, j.status, j.attempts, j.started_at, j.last_error, j.claimed_by, j.tier
), history AS (
  -- claimed_by is the claimer's "host:pid": the history names the drainer that died.
  INSERT INTO {schema}.job_attempts (job_id, attempt, outcome, host, pid, tier, started_at, kill_reason,
                                     duration_seconds, error_head)
  SELECT id, attempts, 'expired', NULLIF(regexp_replace(claimed_by, ':[0-9]+$', ''), ''),
         substring(claimed_by FROM ':([0-9]{1,9})$')::int, tier, started_at, 'claim expired',
         extract(epoch FROM now() - started_at), left(last_error, 500)
  FROM reaped
)
SELECT id, status FROM reaped;

-- name: retry_lock_parents
-- retry's first statement: the parents of the job (and, with children, of the descendants its
-- failure cancelled) are locked FOR SHARE in id order, so that none can end while the retry counts
-- them. A finish committed first is seen by retry and retry_children (each statement's snapshot is
-- taken after this lock); one after waits for the retry to commit and then finds the child waiting
-- (the trigger releases only waiting children: one counted while still cancelled was never
-- released). The job and the descendants being revived are left out (the retry writes them).
-- (test_workflows.py::test_a_retry_racing_its_parents_finish_releases_the_child)
WITH RECURSIVE revived(id) AS (
  SELECT %(id)s::bigint
  UNION
  SELECT d.child_id FROM revived r JOIN {schema}.job_dependencies d ON d.parent_id = r.id
  JOIN {schema}.jobs c ON c.id = d.child_id
  WHERE %(children)s AND c.status = 'cancelled' AND c.last_error LIKE 'parent job %% (on_parent_failure: cancel)'
)
SELECT p.id FROM {schema}.jobs p
WHERE p.id IN (SELECT d.parent_id FROM {schema}.job_dependencies d JOIN revived r ON r.id = d.child_id)
  AND p.id NOT IN (SELECT id FROM revived)
ORDER BY p.id FOR SHARE OF p;

-- name: retry
-- Operator retry of a dead or cancelled job: due now, and at least one more attempt (as Oban).
-- A job that already used the most attempts the table allows (1000) cannot get one more: it is
-- left alone (and the caller says why) instead of failing the CHECK for everyone.
-- It NOTIFYs the job's queue as an enqueue does, so an idle watcher starts it at once.
-- A workflow's child (it has parents) waits again for those of its parents that have not ended
-- yet ('waiting', parents_left); the ended ones count as satisfied, dead or cancelled too (the
-- operator asked for it to run). With no parent left to wait for it is pending, its parents'
-- results in its payload again.
-- A cancelled job's last_error (why it was cancelled: an operator's cancel, a parent's failure)
-- is cleared: it no longer is, and a child waiting again read as cancelled in show and the
-- dashboard (test_workflows.py::test_a_retried_cancelled_child_waits_without_the_cancel_text).
-- A dead job's last error stays (why it died) until its next attempt writes its own.
WITH up AS (
  SELECT j.id, (SELECT count(*) FROM {schema}.job_dependencies d JOIN {schema}.jobs p ON p.id = d.parent_id
                WHERE d.child_id = j.id AND p.status NOT IN ('done', 'dead', 'cancelled')) AS left_,
         ARRAY(SELECT d.parent_id FROM {schema}.job_dependencies d WHERE d.child_id = j.id) AS parents
  FROM {schema}.jobs j WHERE j.id = %(id)s
)
UPDATE {schema}.jobs AS j
SET status = CASE WHEN up.left_ > 0 THEN 'waiting' ELSE 'pending' END, parents_left = up.left_,
    payload = CASE WHEN up.left_ = 0 AND cardinality(up.parents) > 0
                   THEN {schema}.with_parent_results(j.payload, up.parents) ELSE j.payload END,
    run_after = now(), finished_at = NULL, cancel_requested_at = NULL,
    last_error = CASE WHEN j.status = 'cancelled' THEN NULL ELSE j.last_error END,
    max_attempts = GREATEST(max_attempts, attempts + 1)
FROM up
WHERE j.id = up.id AND j.status IN ('dead', 'cancelled') AND j.attempts < 1000
RETURNING j.id, j.status, pg_notify(%(channel)s, j.queue);

-- name: retry_children
-- retry(..., children=True): after the job itself, its descendants that a parent's failure
-- cancelled (last_error says so, on_parent_failure 'cancel') wait again: each counts its parents
-- not ended yet, and those being revived here (they are not done), as left. A descendant with
-- another parent still dead or cancelled (not this job, not one revived here) stays cancelled, and
-- so do its own descendants: that parent would cancel it again, and waiting only for the others it
-- would run while that parent is dead (test_workflows.py::
-- test_retry_children_leaves_a_child_that_another_dead_parent_doomed).
WITH RECURSIVE candidates(id) AS (
  SELECT d.child_id FROM {schema}.job_dependencies d JOIN {schema}.jobs c ON c.id = d.child_id
  WHERE d.parent_id = %(id)s AND c.status = 'cancelled' AND c.last_error LIKE 'parent job %% (on_parent_failure: cancel)'
  UNION
  SELECT d.child_id FROM candidates r JOIN {schema}.job_dependencies d ON d.parent_id = r.id
  JOIN {schema}.jobs c ON c.id = d.child_id
  WHERE c.status = 'cancelled' AND c.last_error LIKE 'parent job %% (on_parent_failure: cancel)'
), blocked(id) AS (
  SELECT d.child_id FROM candidates r JOIN {schema}.job_dependencies d ON d.child_id = r.id
  JOIN {schema}.jobs p ON p.id = d.parent_id
  WHERE p.id <> %(id)s AND p.status IN ('dead', 'cancelled') AND p.id NOT IN (SELECT id FROM candidates)
  UNION
  SELECT d.child_id FROM blocked b JOIN {schema}.job_dependencies d ON d.parent_id = b.id
  JOIN candidates r ON r.id = d.child_id
), revived AS (
  SELECT id FROM candidates EXCEPT SELECT id FROM blocked
), up AS (
  SELECT r.id, (SELECT count(*) FROM {schema}.job_dependencies d JOIN {schema}.jobs p ON p.id = d.parent_id
                WHERE d.child_id = r.id AND (p.id = %(id)s OR p.id IN (SELECT id FROM revived)
                                             OR p.status NOT IN ('done', 'dead', 'cancelled'))) AS left_
  FROM revived r
)
UPDATE {schema}.jobs AS j
SET status = 'waiting', parents_left = up.left_, run_after = now(), finished_at = NULL,
    cancel_requested_at = NULL, last_error = NULL, max_attempts = GREATEST(max_attempts, attempts + 1)
FROM up
WHERE j.id = up.id AND j.status = 'cancelled' AND j.attempts < 1000
RETURNING j.id;

-- name: retry_all_dead
-- A dead job with a key is retried only if no job holds that key now, and only the newest of
-- several dead jobs sharing a key (the unique index allows one pending job per key). A keyed
-- enqueue committed after this statement's snapshot makes it fail on that index: the caller runs
-- it again (Queue.retry_all_dead), and the new snapshot sees the key held and skips the job.
-- NOTIFYs each retried job's queue, as an enqueue does.
-- A dead job is never a workflow's waiting child (a child whose parent failed is cancelled, and
-- it runs only once its parents ended): pending, as before.
UPDATE {schema}.jobs AS j
SET status = 'pending', run_after = now(), finished_at = NULL, cancel_requested_at = NULL,
    max_attempts = GREATEST(j.max_attempts, j.attempts + 1)
WHERE j.status = 'dead' AND j.attempts < 1000
  AND (j.key IS NULL OR (
    NOT EXISTS (SELECT 1 FROM {schema}.jobs o WHERE o.key = j.key AND o.status IN ('pending', 'running', 'waiting'))
    AND j.id = (SELECT max(d.id) FROM {schema}.jobs d WHERE d.key = j.key AND d.status = 'dead')))
RETURNING j.id, pg_notify(%(channel)s, j.queue);

-- name: dead_at_the_ceiling
-- The dead jobs retry_all_dead leaves alone, to name them.
SELECT id FROM {schema}.jobs WHERE status = 'dead' AND attempts >= 1000 ORDER BY id;

-- name: cancel
-- A pending job is cancelled at once. A running one is marked (cancel_requested_at): the drainer
-- holding it polls for the mark, kills its sandbox and writes the attempt's end, which the mark
-- turns into cancelled (so does the reaper, if that drainer died). Returns the status after.
-- A waiting job (a workflow's, its parents not done yet) is cancelled at once, as a pending one.
-- Its last_error says so: what an earlier run left there (a snooze's or a failure's reason) would
-- read as the reason it was cancelled in wait, show and the dashboard.
UPDATE {schema}.jobs
SET status = CASE WHEN status IN ('pending', 'waiting') THEN 'cancelled' ELSE status END,
    finished_at = CASE WHEN status IN ('pending', 'waiting') THEN now() ELSE finished_at END,
    last_error = CASE WHEN status IN ('pending', 'waiting')
                      THEN 'cancelled: an operator cancelled the job while it was ' || status
                           || ' (at ' || to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') || ' UTC)'
                      ELSE last_error END,
    cancel_requested_at = COALESCE(cancel_requested_at, now())
WHERE id = %(id)s AND status IN ('pending', 'running', 'waiting')
RETURNING status;

-- name: cancel_requested
-- The drainer's poll, about once a second while it holds jobs: which of them an operator cancelled.
-- By primary key, so its cost does not grow with the table; matched on the claim (id and token), so
-- a request never reaches another claim of the same job id (one this drain still tears down).
-- The claims come as the held ids and the drain's distinct claim tokens: a running row whose token
-- is one of this drain's is a claim this drain holds (a token is one claim statement's), and the
-- caller matches each (id, token) returned against the claims it holds.
SELECT j.id, j.claim_token FROM {schema}.jobs AS j
WHERE j.id = ANY(%(ids)s::bigint[]) AND j.claim_token = ANY(%(tokens)s::uuid[])
  AND j.status = 'running' AND j.cancel_requested_at IS NOT NULL;

-- name: delete
-- Operator delete of a finished job, with its attempt history (the CTE "history"). Pending and
-- running jobs are cancelled first, so that no drainer is ever left holding a deleted row. Its
-- attempts no scrape has folded into attempt_totals yet (above the mark: they ended within the
-- fold margin) are added to the totals by the same statement, under its kind, so /metrics'
-- counters never drop when a job is deleted soon after it ended (they read the attempts live
-- until then). The CTEs share one snapshot: "folded" reads the attempts that "history" deletes
-- (an attempt committed after the snapshot is left behind: only a job retried, run and finished
-- while this statement waited for its row lock has one, an orphan row no query joins to a job).
-- Run after fold_lock in the same transaction, so no fold is counting them meanwhile.
WITH gone AS (
  DELETE FROM {schema}.jobs
  WHERE id = %(id)s AND status IN ('done', 'dead', 'cancelled')
  RETURNING id, kind
), folded AS (
  SELECT g.kind, CASE a.outcome WHEN 'retry' THEN 'failed' ELSE a.outcome END AS outcome,
         CASE WHEN a.duration_seconds IS NULL THEN -1
              ELSE COALESCE((%(bounds)s::float8[])[cardinality(%(bounds)s::float8[]) + 1
                            - width_bucket(-a.duration_seconds, %(negated)s::float8[])], 'Infinity') END AS bound,
         count(*) AS n, COALESCE(sum(a.duration_seconds), 0) AS seconds
  FROM {schema}.job_attempts a
  JOIN gone g ON g.id = a.job_id
  WHERE a.id > (SELECT last_id FROM {schema}.attempt_totals_mark)
  GROUP BY 1, 2, 3
), added AS (
  INSERT INTO {schema}.attempt_totals AS t (kind, outcome, bound, n, seconds)
  SELECT kind, outcome, bound, n, seconds FROM folded
  ON CONFLICT (kind, outcome, bound)
  DO UPDATE SET n = t.n + EXCLUDED.n, seconds = t.seconds + EXCLUDED.seconds
), history AS (
  DELETE FROM {schema}.job_attempts a USING gone g WHERE a.job_id = g.id
), edges_up AS (
  -- its edges (workflows): no job still waits on a finished job, which counted as ended already
  DELETE FROM {schema}.job_dependencies d USING gone g WHERE d.child_id = g.id
), edges_down AS (
  DELETE FROM {schema}.job_dependencies d USING gone g WHERE d.parent_id = g.id
)
SELECT id FROM gone;

-- name: fold_lock
-- Taken (until the transaction ends) by a write that adds attempts to attempt_totals itself
-- (delete, prune_batch): the row lock of attempt_totals_mark. A fold holding it is waited for, so
-- the write then reads the mark it moved; a fold starting meanwhile skips the locked row and folds
-- nothing, so no attempt is counted twice. A row of fleetless's own table, not an advisory key
-- that any role able to connect could hold (issue 25 item 7).
SELECT last_id FROM {schema}.attempt_totals_mark FOR UPDATE;

-- name: fold_try_lock
-- fold_lock for retention: a drain's pass skips (prunes nothing this time) while a fold or another
-- pruner holds the lock, instead of queueing behind it (four empty drains took 3-7 s so).
SELECT true AS got FROM {schema}.attempt_totals_mark FOR UPDATE SKIP LOCKED;

-- name: maintenance_turn
-- A periodic maintenance task's turn in this database: true for the one caller that finds it last
-- ran %(every)s seconds ago or more (or never) and marks it run now; the others get no row.
INSERT INTO {schema}.maintenance_runs AS m (name, last_at) VALUES (%(name)s, now())
ON CONFLICT (name) DO UPDATE SET last_at = now()
  WHERE m.last_at <= now() - make_interval(secs => %(every)s::float8)
RETURNING true AS mine;

-- name: attempts
-- One job's attempt history, oldest first. 'retry' (written before migration 024, or by an older
-- drainer) reads as 'failed', what a plain failure with attempts left is called now.
SELECT attempt, CASE outcome WHEN 'retry' THEN 'failed' ELSE outcome END AS outcome, snooze, host, pid, tier,
       started_at, finished_at, exit_code, signal, kill_reason, duration_seconds, error_head
FROM {schema}.job_attempts WHERE job_id = %(id)s ORDER BY id;

-- name: status_of
SELECT status, attempts FROM {schema}.jobs WHERE id = %(id)s;

-- name: get
SELECT id, kind, queue, status, priority, attempts, max_attempts, snoozes, payload, run_after, created_at,
       locked_at, started_at, finished_at, lease_expires_at, timeout_seconds, claim_token,
       claimed_by, tier, last_error, result, result_json, key, cancel_requested_at, parents_left,
       on_parent_failure
FROM {schema}.jobs WHERE id = %(id)s;

-- name: wait_mark
-- Queue.wait: register as the job's waiter (migration 019's trigger then NOTIFYs its id when it
-- finishes). The caller LISTENs before this and reads the job after it (wait_read), so a finish
-- that commits after this row is visible wakes it, and one committed before shows as final. A job
-- that has finished already gets no row (nothing would ever remove it: its finish is past); the
-- job's id comes back all the same ("no row": no such job).
WITH job AS (SELECT id, status FROM {schema}.jobs WHERE id = %(id)s),
mark AS (
  INSERT INTO {schema}.job_waiters (job_id)
  SELECT id FROM job WHERE status NOT IN ('done', 'dead', 'cancelled')
)
SELECT id AS job_id FROM job;

-- name: wait_done
-- Queue.wait, returning: its waiter row goes (the trigger removes those of finished jobs itself).
DELETE FROM {schema}.job_waiters
WHERE ctid = (SELECT ctid FROM {schema}.job_waiters WHERE job_id = %(id)s LIMIT 1);

-- name: forget_waiters
-- The waiters unit (maintenance/waiters.py): waiter rows whose job has finished or is gone, which
-- no finish will remove any more (a waiter killed in the race wait_read describes, its job then
-- maybe deleted). At most %(limit)s a statement; the rows of unfinished jobs stay.
DELETE FROM {schema}.job_waiters
WHERE ctid = ANY(ARRAY(
  SELECT w.ctid FROM {schema}.job_waiters w
  WHERE NOT EXISTS (SELECT 1 FROM {schema}.jobs j
                    WHERE j.id = w.job_id AND j.status NOT IN ('done', 'dead', 'cancelled'))
  LIMIT %(limit)s));

-- name: wait_read
-- Queue.wait, once woken: the finished job's outcome. "touched": some transaction has locked or
-- changed this row version (its xmax is set). A finish whose trigger ran before this waiter's row
-- was visible (so it NOTIFYs no one) still holds that lock while uncommitted: the caller then reads
-- again with wait_read_settled, which waits for it (issue 26: else up to WAIT_RECHECK late).
SELECT id, kind, queue, status, attempts, result, result_json, last_error, finished_at,
       xmax::text <> '0' AS touched
FROM {schema}.jobs WHERE id = %(id)s;

-- name: wait_read_settled
-- Queue.wait, after wait_read saw an unfinished job that a transaction had touched: FOR SHARE
-- waits for a writer still in flight (a finish that could not see this waiter's row) and reads the
-- row as it committed it. Taken only then: a share lock on a pending job would make a claim
-- (SKIP LOCKED) pass it over for that instant.
SELECT id, kind, queue, status, attempts, result, result_json, last_error, finished_at,
       false AS touched
FROM {schema}.jobs WHERE id = %(id)s
FOR SHARE;

-- name: list
-- Newest first; filters are optional. Keyset paging on id (before), so page 1,000 costs what page
-- 1 does. The whole last_error (at most 2,000 characters) comes back so its first line can be shown.
SELECT id, kind, queue, status, priority, attempts, max_attempts, run_after, created_at,
       finished_at, last_error
FROM {schema}.jobs
WHERE (%(status)s::text IS NULL OR status = %(status)s::text)
  AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
  AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
  AND (%(before)s::bigint IS NULL OR id < %(before)s::bigint)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: counts
-- From job_counts (kept by the triggers of migration 016), never by counting the jobs table.
SELECT kind, status, sum(n)::bigint AS n FROM {schema}.job_counts
GROUP BY kind, status HAVING sum(n) <> 0 ORDER BY kind, status;

-- name: counts_lock
-- compact_counts' and recount's first statement: one folder at a time. SHARE UPDATE EXCLUSIVE
-- conflicts with itself but not with the triggers' inserts (ROW EXCLUSIVE), so job writes go on.
-- The fold adds NOWAIT (a second one folds nothing rather than wait: a LockTimeout, skipped);
-- recount waits, so a fold's new rows are never left beside a recount's. A table of fleetless's
-- own, not an advisory key that any role able to connect could hold (issue 25 item 7).
LOCK TABLE {schema}.job_counts IN SHARE UPDATE EXCLUSIVE MODE;

-- name: compact_counts
-- Folds job_counts' rows (one per job-changing statement since the last fold) into one row per
-- (queue, kind, status), so that reading the counts stays a scan of a few rows. Under
-- counts_lock (NOWAIT). Readers see the rows before or after it commits, which sum to the same
-- counts.
WITH gone AS (
  DELETE FROM {schema}.job_counts
  RETURNING queue, kind, status, n
)
INSERT INTO {schema}.job_counts (queue, kind, status, n)
SELECT queue, kind, status, sum(n) FROM gone GROUP BY queue, kind, status HAVING sum(n) <> 0;

-- name: lock_jobs_share
-- Then hold off every job write until the recount commits (SHARE waits for the writers in flight
-- and blocks new ones; reads go on), so no change is missed or counted twice.
LOCK TABLE {schema}.jobs IN SHARE MODE;

-- name: recount
-- `fleetless init --recount`, under counts_lock and LOCK TABLE jobs IN SHARE MODE: job_counts
-- made again from the jobs table (repairs counts a trigger did not see, e.g. after the triggers
-- were disabled by hand). Returns how many rows of job_counts were wrong (keys whose sum differed).
WITH truth AS (
  SELECT queue, kind, status, count(*) AS n FROM {schema}.jobs GROUP BY queue, kind, status
), kept AS (
  SELECT queue, kind, status, sum(n) AS n FROM {schema}.job_counts GROUP BY queue, kind, status
), gone AS (
  DELETE FROM {schema}.job_counts
), made AS (
  INSERT INTO {schema}.job_counts (queue, kind, status, n) SELECT queue, kind, status, n FROM truth
)
SELECT count(*) AS wrong FROM truth t FULL JOIN kept k USING (queue, kind, status)
WHERE COALESCE(t.n, 0) <> COALESCE(k.n, 0);

-- name: pending_times
-- Oldest due-and-waiting job and the next one due: two first rows of the partial index on
-- run_after (an aggregate with FILTER would read every pending row: 1M of them at scale).
SELECT extract(epoch FROM now() - o.run_after)::float8 AS oldest_due_age_seconds,
       extract(epoch FROM (SELECT min(run_after) FROM {schema}.jobs
                           WHERE status = 'pending' AND run_after > now()) - now())::float8
         AS next_due_in_seconds
FROM (SELECT 1) AS one
LEFT JOIN (SELECT min(run_after) AS run_after FROM {schema}.jobs WHERE status = 'pending') AS o
  ON o.run_after <= now();

-- name: held_back
-- `fleetless status`: what the limits hold back now. Every paused queue, and every queue with a
-- concurrency, with its running rows and whether a job of it is due; every limited kind the
-- caller's fleetless.toml names (kinds, with its concurrency, rate and window, as arrays), with its
-- running rows, its starts in the window (kind_starts) and whether a job of it is due. The caller
-- says which limits are reached. A few index probes per limited queue or kind.
SELECT 'queue' AS what, s.queue AS name, s.paused, s.concurrency, NULL::int AS rate, NULL::float8 AS "window",
       (SELECT count(*) FROM {schema}.jobs j WHERE j.queue = s.queue AND j.status = 'running') AS running,
       0::bigint AS started,
       EXISTS (SELECT 1 FROM {schema}.jobs j
               WHERE j.queue = s.queue AND j.status = 'pending' AND j.run_after <= now()) AS due
FROM {schema}.queue_settings s
WHERE s.paused OR s.concurrency IS NOT NULL
UNION ALL
SELECT 'kind', k.kind, false, k.concurrency, k.rate, k.seconds,
       (SELECT count(*) FROM {schema}.jobs j WHERE j.kind = k.kind AND j.status = 'running'),
       (SELECT count(*) FROM {schema}.kind_starts st
        WHERE k.rate IS NOT NULL AND st.kind = k.kind AND st.started_at > now() - make_interval(secs => k.seconds)),
       EXISTS (SELECT 1 FROM {schema}.jobs j WHERE j.kind = k.kind AND j.status = 'pending' AND j.run_after <= now())
FROM unnest(%(kinds)s::text[], %(concurrency)s::int[], %(rate)s::int[], %(seconds)s::float8[])
     AS k(kind, concurrency, rate, seconds)
ORDER BY 1 DESC, 2;

-- name: prune_graphs_at
-- Where retention's graph step left off (prune_graphs_mark): the last graph label it looked at.
SELECT position FROM {schema}.maintenance_runs WHERE name = 'retention_graphs';

-- name: prune_graphs_next
-- Retention's graph step: the labels of the next %(graphs)s workflow graphs (NULL: all) after
-- %(after)s, in label order, by a loose scan of jobs_graph_idx: each label the first entry after
-- the one before, so a graph costs the step one probe here however many jobs it has.
WITH RECURSIVE g(id, n) AS (
  SELECT (SELECT min(graph_id) FROM {schema}.jobs WHERE graph_id > %(after)s::bigint), 1
  UNION ALL
  SELECT (SELECT min(j.graph_id) FROM {schema}.jobs j WHERE j.graph_id > g.id), g.n + 1
  FROM g WHERE g.id IS NOT NULL AND (%(graphs)s::int IS NULL OR g.n < %(graphs)s::int)
)
SELECT id FROM g WHERE id IS NOT NULL;

-- name: prune_graphs_mark
-- Retention's graph step moves its cursor (kept between passes, runs and drains; pruners take
-- turns under fold_lock, so one writes it at a time).
INSERT INTO {schema}.maintenance_runs (name, last_at, position) VALUES ('retention_graphs', now(), %(position)s)
ON CONFLICT (name) DO UPDATE SET last_at = now(), position = EXCLUDED.position;

-- name: prune_batch
-- The pruner (retention, and `fleetless prune`): finished jobs older than the age given for their
-- status (NULL: that status is kept), at most %(limit)s rows (NULL: all) so that one statement
-- stays short. SKIP LOCKED: two pruners at once split the rows instead of queueing behind each
-- other; a row's status and age are checked again once it is locked. A job's attempt history goes
-- with it (the CTE "history"). As delete does (and after fold_lock, likewise), the deleted jobs'
-- attempts no scrape has folded yet are added to attempt_totals first, so pruning inside the fold
-- margin never lowers the counters. The deleted jobs' edges go with them.
-- Jobs in no graph: each status is one range of jobs_finished_free_idx (status, finished_at; only
-- jobs in no graph, migration 030) read from its oldest row, so a pass reads the rows it deletes
-- and stops, however many younger finished rows there are, and however many old jobs of graphs
-- still held there are (they lay at the front of every pass: 2.7-5.6 s a pass beside 1M of them).
-- A finished job is also kept while any child of it has not ended (a probe of the edges' primary
-- key, the child's status by its primary key): an enqueuer older than migration 028 writes a
-- workflow without graph labels, and its child reads its parents' results when it is released.
-- Workflows: the graphs %(graphs)s (labels, prune_graphs_next) go as a whole: a graph's jobs only
-- once every job of it has finished and is past its status' age (no job is pruned while a
-- descendant, a sibling or any other job of its graph waits, runs or is young). The check is at
-- most four probes of jobs_graph_idx per graph, each the first entry of an index range, stopping
-- at the first that finds a job (one still waiting, pending or running; a done, a cancelled, a
-- dead one inside its age: a NULL age keeps that status forever, so any). A graph's jobs come
-- first in the batch, graph by graph in the order given; a graph larger than what is left of the
-- batch goes over the next passes. The same per-job edge check applies (a child an older
-- enqueuer added carries no label). A graph's jobs of this batch go together or not at all
-- (kept): none if one of them is locked (an open enqueue adding a child holds its parent: the
-- rest of the graph went, before) or was labelled since the check; a job in no graph labelled
-- since it was found (an enqueue made it a parent) is kept too.
WITH due AS (
    SELECT due.id, due.gid FROM (
      (SELECT r.id, g.id AS gid, 0 AS part, g.o, r.finished_at
       FROM unnest(%(graphs)s::bigint[]) WITH ORDINALITY AS g(id, o)
       CROSS JOIN LATERAL (
         SELECT m.id, m.finished_at FROM {schema}.jobs m
         WHERE m.graph_id = g.id AND m.status IN ('done', 'cancelled', 'dead')
           AND NOT EXISTS (SELECT FROM {schema}.job_dependencies d WHERE d.parent_id = m.id
                           AND (SELECT c.status FROM {schema}.jobs c WHERE c.id = d.child_id)
                               IN ('waiting', 'pending', 'running'))
         LIMIT %(limit)s) AS r
       WHERE NOT EXISTS (
               (SELECT FROM {schema}.jobs m WHERE m.graph_id = g.id
                  AND m.status IN ('waiting', 'pending', 'running') LIMIT 1)
               UNION ALL (SELECT FROM {schema}.jobs m WHERE m.graph_id = g.id AND m.status = 'done'
                  AND m.finished_at >= COALESCE(now() - make_interval(secs => %(done)s::float8), '-infinity') LIMIT 1)
               UNION ALL (SELECT FROM {schema}.jobs m WHERE m.graph_id = g.id AND m.status = 'cancelled'
                  AND m.finished_at >= COALESCE(now() - make_interval(secs => %(cancelled)s::float8), '-infinity')
                  LIMIT 1)
               UNION ALL (SELECT FROM {schema}.jobs m WHERE m.graph_id = g.id AND m.status = 'dead'
                  AND m.finished_at >= COALESCE(now() - make_interval(secs => %(dead)s::float8), '-infinity') LIMIT 1))
       LIMIT %(limit)s)
      UNION ALL
      (SELECT free.id, NULL::bigint, 1, 0, free.finished_at FROM (
        (SELECT id, finished_at FROM {schema}.jobs
         WHERE status = 'done' AND graph_id IS NULL AND finished_at < now() - make_interval(secs => %(done)s::float8)
           AND NOT EXISTS (SELECT FROM {schema}.job_dependencies d WHERE d.parent_id = jobs.id
                           AND (SELECT c.status FROM {schema}.jobs c WHERE c.id = d.child_id)
                               IN ('waiting', 'pending', 'running'))
         ORDER BY status, finished_at LIMIT %(limit)s)
        UNION ALL
        (SELECT id, finished_at FROM {schema}.jobs
         WHERE status = 'cancelled' AND graph_id IS NULL
           AND finished_at < now() - make_interval(secs => %(cancelled)s::float8)
           AND NOT EXISTS (SELECT FROM {schema}.job_dependencies d WHERE d.parent_id = jobs.id
                           AND (SELECT c.status FROM {schema}.jobs c WHERE c.id = d.child_id)
                               IN ('waiting', 'pending', 'running'))
         ORDER BY status, finished_at LIMIT %(limit)s)
        UNION ALL
        (SELECT id, finished_at FROM {schema}.jobs
         WHERE status = 'dead' AND graph_id IS NULL AND finished_at < now() - make_interval(secs => %(dead)s::float8)
           AND NOT EXISTS (SELECT FROM {schema}.job_dependencies d WHERE d.parent_id = jobs.id
                           AND (SELECT c.status FROM {schema}.jobs c WHERE c.id = d.child_id)
                               IN ('waiting', 'pending', 'running'))
         ORDER BY status, finished_at LIMIT %(limit)s)
       ) AS free
       ORDER BY free.finished_at LIMIT %(limit)s)
    ) AS due
    ORDER BY due.part, due.o, due.finished_at LIMIT %(limit)s
), locked AS (
  SELECT id, graph_id FROM {schema}.jobs
  WHERE id = ANY(ARRAY(SELECT id FROM due))
    AND status IN ('done', 'cancelled', 'dead')
    AND finished_at < now() - make_interval(secs => CASE status
          WHEN 'done' THEN %(done)s::float8
          WHEN 'cancelled' THEN %(cancelled)s::float8
          ELSE %(dead)s::float8 END)
  FOR UPDATE SKIP LOCKED
), kept AS (
  -- due, but not locked here (skipped), or labelled since it was found due
  SELECT d.id, d.gid FROM due d LEFT JOIN locked l ON l.id = d.id
  WHERE l.id IS NULL OR l.graph_id IS DISTINCT FROM d.gid
), gone AS (
DELETE FROM {schema}.jobs
WHERE id = ANY(ARRAY(
  SELECT l.id FROM locked l JOIN due d ON d.id = l.id
  WHERE l.graph_id IS NOT DISTINCT FROM d.gid
    AND (d.gid IS NULL OR d.gid NOT IN (SELECT k.gid FROM kept k WHERE k.gid IS NOT NULL))))
RETURNING id, kind, graph_id
), folded AS (
  SELECT g.kind, CASE a.outcome WHEN 'retry' THEN 'failed' ELSE a.outcome END AS outcome,
         CASE WHEN a.duration_seconds IS NULL THEN -1
              ELSE COALESCE((%(bounds)s::float8[])[cardinality(%(bounds)s::float8[]) + 1
                            - width_bucket(-a.duration_seconds, %(negated)s::float8[])], 'Infinity') END AS bound,
         count(*) AS n, COALESCE(sum(a.duration_seconds), 0) AS seconds
  FROM {schema}.job_attempts a
  JOIN gone g ON g.id = a.job_id
  WHERE a.id > (SELECT last_id FROM {schema}.attempt_totals_mark)
  GROUP BY 1, 2, 3
), added AS (
  INSERT INTO {schema}.attempt_totals AS t (kind, outcome, bound, n, seconds)
  SELECT kind, outcome, bound, n, seconds FROM folded
  ON CONFLICT (kind, outcome, bound)
  DO UPDATE SET n = t.n + EXCLUDED.n, seconds = t.seconds + EXCLUDED.seconds
), history AS (
  DELETE FROM {schema}.job_attempts a USING gone g WHERE a.job_id = g.id
), edges_up AS (
  -- its edges (workflows): no job still waits on a finished job, which counted as ended already
  DELETE FROM {schema}.job_dependencies d USING gone g WHERE d.child_id = g.id
), edges_down AS (
  DELETE FROM {schema}.job_dependencies d USING gone g WHERE d.parent_id = g.id
)
SELECT id, graph_id FROM gone;

-- name: finish_many
-- The completer's one statement per flush: many outcomes (done, failed, released) in one UPDATE
-- over the rows of one JSON array, so a batch of small jobs costs one round trip instead of one per
-- job. One JSON parameter, not twelve arrays: the client encodes it with the json module's C
-- encoder, where psycopg dumps each array element in Python (the batch drain's largest client
-- cost per job). Each row: [id, token, action, permanent, delay, error, result, result_json (as
-- text), tier, exit_code, signal, kill_reason, decided].
-- Each row is still fenced on (id, claim_token, status = 'running'): a drainer whose claim was
-- reaped and taken over matches nothing and learns it from the rows not returned. Every outcome,
-- a release too, writes the claim's token into its history row, so that a retry after a lost
-- reply recognises its own earlier write (outcomes_of), also once the job was claimed again.
-- action: 'done'; 'fail' (back to pending after delay while attempts are left and the failure is
-- not permanent, else dead); 'release' (pending, the attempt given back: not the job's fault),
-- bounded as in release: the max_releases-th in a row is charged as a failure instead;
-- 'snooze' (the handler asked to come back after delay: fleetless.outcomes.Snooze, exit code 91):
-- pending after delay, the attempt given back, bounded by the job's own count: a snooze past
-- max_snoozes is charged as a failure instead. The history names each: 'failed' (a failure with
-- attempts left), 'retried' (the same, asked by the handler: decided 'retry'), 'discarded' (decided
-- 'discard', dead at once), 'snoozed' (with the job's snooze count in "snooze"), 'dead', 'released'.
-- Each written row's attempt gets its history row in the same statement (a data-modifying CTE);
-- "was" is the row before this update, for the number and start of an attempt given back, and
-- the tier its claim recorded when the outcome does not say (batch mode).
-- A job whose cancel was requested (cancel_requested_at, set by `fleetless cancel` while it ran)
-- never goes back to pending: what would have been a retry or a give-back ends it cancelled, and
-- its last_error leads with the cancel (the attempt's own end after it: a snooze's reason alone
-- would read as why it was cancelled); the history row keeps the attempt's own error. A retry the
-- handler asked for on its last attempt ends dead, its last_error led by "no attempts left (N/N); ".
-- A no-handler give-back hands its start back to its kind's rate limit (unstarted, refunded).
WITH finished AS (
UPDATE {schema}.jobs AS j
SET status = CASE
      WHEN o.act = 'done' THEN 'done'
      WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
      WHEN o.act IN ('release', 'snooze') THEN 'pending'
      WHEN j.attempts < j.max_attempts AND NOT o.permanent THEN 'pending'
      ELSE 'dead' END,
    attempts = CASE WHEN o.act IN ('release', 'snooze') AND j.cancel_requested_at IS NULL
                    THEN GREATEST(j.attempts - 1, 0) ELSE j.attempts END,
    run_after = CASE WHEN o.act = 'fail' AND j.cancel_requested_at IS NULL AND j.attempts < j.max_attempts
                          AND NOT o.permanent
                     THEN now() + make_interval(secs => o.delay)
                     -- a release with a delay (a kind with no handler here yet) comes back after it
                     WHEN o.act IN ('release', 'snooze') AND o.delay > 0 THEN now() + make_interval(secs => o.delay)
                     ELSE j.run_after END,
    finished_at = CASE
      WHEN o.act = 'done' THEN now()
      WHEN j.cancel_requested_at IS NOT NULL THEN now()
      WHEN o.act = 'fail' AND NOT (j.attempts < j.max_attempts AND NOT o.permanent) THEN now()
      ELSE NULL END,
    last_error = CASE WHEN o.act <> 'done' AND j.cancel_requested_at IS NOT NULL AND o.err NOT LIKE 'cancelled:%%'
                      THEN 'cancelled: an operator cancelled the job while it ran; its attempt ended: ' || o.err
                      -- a retry the handler asked for on the last attempt: dead, and its error says so
                      -- first (it read as if the job would run again; the history keeps the request)
                      WHEN o.act = 'fail' AND o.decided = 'retry' AND NOT o.permanent AND j.attempts >= j.max_attempts
                      THEN 'no attempts left (' || j.attempts || '/' || j.max_attempts || '); ' || o.err
                      ELSE o.err END,
    releases = CASE WHEN o.act = 'release' THEN j.releases + 1 WHEN o.act = 'fail' THEN 0 ELSE j.releases END,
    snoozes = CASE WHEN o.act = 'snooze' THEN j.snoozes + 1 ELSE j.snoozes END,
    result = CASE WHEN o.act IN ('release', 'snooze') THEN j.result ELSE o.result END,
    result_json = CASE WHEN o.act IN ('release', 'snooze') THEN j.result_json ELSE o.result_json::jsonb END,
    started_at = CASE WHEN o.act IN ('release', 'snooze') THEN NULL ELSE j.started_at END,
    locked_at = NULL, lease_expires_at = NULL
FROM (SELECT u.*, was.attempts AS was_attempts, was.started_at AS was_started_at, was.tier AS was_tier,
             -- a release that is the max_releases-th in a row is charged: it becomes a failure
             -- so is a snooze past the job's max_snoozes (the drain's report says the same words:
             -- events.spent_words, from the job's counts at its claim)
             CASE WHEN u.action = 'release' AND was.releases + 1 >= %(max_releases)s THEN 'fail'
                  WHEN u.action = 'snooze' AND was.snoozes >= %(max_snoozes)s THEN 'fail'
                  ELSE u.action END AS act,
             CASE WHEN u.action = 'release' AND was.releases + 1 >= %(max_releases)s
                  THEN 'released ' || (was.releases + 1) || ' times in a row; charged as an attempt: ' || u.error
                  WHEN u.action = 'snooze' AND was.snoozes >= %(max_snoozes)s
                  THEN 'snoozed ' || was.snoozes || ' times already, the most a job may; charged as a failed attempt: '
                       || u.error
                  ELSE u.error END AS err
      FROM (SELECT (e->>0)::bigint AS id, (e->>1)::uuid AS token, e->>2 AS action, (e->>3)::bool AS permanent,
                   (e->>4)::float8 AS delay, e->>5 AS error, e->>6 AS result, e->>7 AS result_json,
                   e->>8 AS tier, (e->>9)::int AS exit_code, e->>10 AS signal, e->>11 AS kill_reason,
                   e->>12 AS decided
            FROM jsonb_array_elements(%(rows)s::jsonb) AS e) AS u
           JOIN {schema}.jobs AS was ON was.id = u.id) AS o
WHERE j.id = o.id AND j.claim_token = o.token AND j.status = 'running'
RETURNING j.id, j.status, o.act AS action, o.decided, o.was_attempts AS attempts, o.was_started_at AS started_at,
          j.snoozes, o.token,
          COALESCE(o.tier, o.was_tier) AS tier,
          o.exit_code, o.signal,
          o.kill_reason, o.err AS error, j.kind, (o.action = 'release' AND o.delay > 0) AS gave_back
), unstarted AS (
  -- no-handler give-backs (the one release with a delay: the job never started here), per claim
  SELECT kind, started_at, count(*) AS n FROM finished WHERE gave_back GROUP BY kind, started_at
), refunded AS (
  -- ... take back their starts from a rate-limited kind's window (claim_limited logged one per
  -- job, at the claim's time, which is also each job's started_at): a give-back spends none of it
  DELETE FROM {schema}.kind_starts s
  WHERE s.ctid = ANY(ARRAY(
    SELECT x.ctid FROM (
      SELECT k.ctid, u.n, row_number() OVER (PARTITION BY k.kind, k.started_at) AS nth
      FROM {schema}.kind_starts k JOIN unstarted u ON u.kind = k.kind AND u.started_at = k.started_at) AS x
    WHERE x.nth <= x.n))
), history AS (
  INSERT INTO {schema}.job_attempts (job_id, attempt, outcome, host, pid, tier, started_at,
                                     exit_code, signal, kill_reason, duration_seconds, error_head, snooze,
                                     claim_token)
  SELECT id, attempts,
         CASE WHEN status = 'cancelled' THEN 'cancelled' WHEN action = 'release' THEN 'released'
              WHEN action = 'snooze' THEN 'snoozed'
              WHEN status = 'dead' AND decided = 'discard' THEN 'discarded'
              WHEN status = 'pending' AND decided = 'retry' THEN 'retried'
              WHEN status = 'pending' THEN 'failed' ELSE status END,
         %(host)s, %(pid)s, tier, started_at, exit_code, signal, kill_reason,
         extract(epoch FROM now() - started_at), left(error, 500),
         CASE WHEN action = 'snooze' AND status = 'pending' THEN snoozes END, token
  FROM finished
)
SELECT id, status FROM finished;

-- name: finish_done
-- finish_many for a flush whose outcomes are all 'done' (a batch of small jobs, nearly always):
-- the same rows, fence, columns and history, without what only a failure or a give-back needs.
-- A done row keeps its attempts, started_at and tier, so RETURNING's values are the attempt's own
-- and the row before the update is not joined again (a fifth of a large flush's time); done wins
-- over a requested cancel, as in finish_many.
WITH finished AS (
UPDATE {schema}.jobs AS j
SET finished_at = now(), status = 'done', last_error = o.error, result = o.result,
    result_json = o.result_json::jsonb, locked_at = NULL, lease_expires_at = NULL
FROM (SELECT (e->>0)::bigint AS id, (e->>1)::uuid AS token, e->>5 AS error, e->>6 AS result,
             e->>7 AS result_json, e->>8 AS tier, (e->>9)::int AS exit_code, e->>10 AS signal,
             e->>11 AS kill_reason
      FROM jsonb_array_elements(%(rows)s::jsonb) AS e) AS o
WHERE j.id = o.id AND j.claim_token = o.token AND j.status = 'running'
RETURNING j.id, j.attempts, j.started_at, COALESCE(o.tier, j.tier) AS tier, o.exit_code, o.signal,
          o.kill_reason, o.error, o.token
), history AS (
  INSERT INTO {schema}.job_attempts (job_id, attempt, outcome, host, pid, tier, started_at,
                                     exit_code, signal, kill_reason, duration_seconds, error_head, claim_token)
  SELECT id, attempts, 'done', %(host)s, %(pid)s, tier, started_at, exit_code, signal, kill_reason,
         extract(epoch FROM now() - started_at), left(error, 500), token
  FROM finished
)
SELECT id, 'done' FROM finished;

-- name: extend_leases
-- Batch mode: jobs wait behind each other in one sandbox, so the leases set at claim (own timeout
-- plus grace) would expire under a live drainer. While a batch runs, its drainer renews all of its
-- leases with this one statement, fenced per row like a finish; a dead drainer renews nothing and
-- the reaper takes its batch back as before.
UPDATE {schema}.jobs AS j
SET lease_expires_at = now() + make_interval(
        secs => LEAST(COALESCE(j.timeout_seconds, %(default_timeout)s::float8), %(ttl)s::float8) + %(grace)s::float8)
-- The claims as in cancel_requested: held ids and the drain's distinct tokens (a running row with
-- one of its tokens is a claim it holds), so the fence is still the claim token and the status.
WHERE j.id = ANY(%(ids)s::bigint[]) AND j.claim_token = ANY(%(tokens)s::uuid[]) AND j.status = 'running'
-- the lease left, by the database's clock: the drainer keeps each job's lease end (no job of it
-- starts after that, also in a batch runner the drainer cannot reach while it is stopped)
RETURNING j.id, extract(epoch FROM j.lease_expires_at - now())::float8;

-- name: claim_kind
-- Batch mode's claim: up to n due jobs of one kind (they share one sandbox and one imported
-- handler). The kind is the one of the first due job in claim order, so a drain with many kinds
-- reaches each kind's oldest job in turn instead of starving the rare ones. The head row is
-- locked by the CTE and therefore not skipped by the claim that follows. A kind's batch_size
-- (fleetless.toml, in kinds) replaces the drain's n for its batches.
-- The rows come back in run order (priority, then id), sorted here rather than by the client.
-- Paused and concurrency-limited queues are left out, as in claim.
-- With skip_kinds, the head is found as claim finds its rows with them: the first due row of each
-- (kind, queue) pair the drain may take, never a read through the skipped kinds' backlog.
WITH RECURSIVE pair AS (
  (SELECT kind, queue FROM {schema}.jobs
   WHERE status = 'pending' AND %(skip_kinds)s::text[] IS NOT NULL ORDER BY kind, queue LIMIT 1)
  UNION ALL
  SELECT nx.kind, nx.queue FROM pair p CROSS JOIN LATERAL (
    SELECT kind, queue FROM {schema}.jobs
    WHERE status = 'pending' AND (kind, queue) > (p.kind, p.queue) ORDER BY kind, queue LIMIT 1) AS nx
), head AS (
  SELECT COALESCE((
    SELECT kind FROM {schema}.jobs
    WHERE status = 'pending' AND run_after <= now() AND %(skip_kinds)s::text[] IS NULL
      AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
      AND (CASE WHEN queue = ANY(ARRAY(SELECT queue FROM {schema}.queue_settings WHERE paused OR concurrency IS NOT NULL))
                THEN NULL ELSE 1 END) IS NOT NULL
    ORDER BY priority DESC, run_after
    FOR UPDATE SKIP LOCKED
    LIMIT 1), (
   SELECT p.kind FROM pair p CROSS JOIN LATERAL (
     SELECT priority, run_after FROM {schema}.jobs
     WHERE status = 'pending' AND kind = p.kind AND queue = p.queue AND run_after <= now()
     ORDER BY priority DESC, run_after
     FOR UPDATE SKIP LOCKED
     LIMIT 1) AS c
   WHERE p.kind <> ALL(%(skip_kinds)s::text[])
     AND (%(queues)s::text[] IS NULL OR p.queue = ANY(%(queues)s::text[]))
     AND (CASE WHEN p.queue = ANY(ARRAY(SELECT queue FROM {schema}.queue_settings WHERE paused OR concurrency IS NOT NULL))
               THEN NULL ELSE 1 END) IS NOT NULL
   ORDER BY c.priority DESC, c.run_after
   LIMIT 1)) AS kind
), claimed AS (
UPDATE {schema}.jobs AS j
SET status = 'running',
    attempts = j.attempts + 1,
    claim_token = %(token)s,
    locked_at = now(),
    started_at = now(),
    finished_at = NULL,
    claimed_by = %(claimed_by)s,
    tier = COALESCE(%(kinds)s::jsonb -> j.kind ->> 'tier', %(tier)s),
    max_attempts = CASE WHEN j.max_attempts_default
                        THEN GREATEST(COALESCE((%(kinds)s::jsonb -> j.kind ->> 'max_attempts')::int, 3),
                                      j.attempts + 1)
                        ELSE j.max_attempts END,
    lease_expires_at = now() + make_interval(
        secs => LEAST(COALESCE(j.timeout_seconds, %(default_timeout)s::float8), %(ttl)s::float8) + %(grace)s::float8)
-- (ids as one array: see claim)
WHERE j.id = ANY(ARRAY(
  SELECT id FROM {schema}.jobs
  WHERE status = 'pending' AND run_after <= now()
    AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
    AND kind = (SELECT kind FROM head) AND (SELECT kind FROM head) IS NOT NULL  -- (none: no read at all)
    AND (CASE WHEN queue = ANY(ARRAY(SELECT queue FROM {schema}.queue_settings WHERE paused OR concurrency IS NOT NULL))
              THEN NULL ELSE 1 END) IS NOT NULL
  ORDER BY priority DESC, run_after
  FOR UPDATE SKIP LOCKED
  LIMIT COALESCE((%(kinds)s::jsonb -> (SELECT kind FROM head) ->> 'batch_size')::int, %(n)s)
))
RETURNING j.id, j.kind, j.payload::text AS payload_json, j.attempts, j.max_attempts, j.claim_token,
          j.timeout_seconds, j.queue, j.priority,
          extract(epoch FROM j.lease_expires_at - now())::float8 AS lease_seconds, j.snoozes, j.releases
)
SELECT * FROM claimed ORDER BY priority DESC, id;

-- name: limited_kinds_due
-- Which of the kinds with a global limit have a due job in the drain's queues: the limited claim
-- (a transaction under the kind's lock) runs only for these, so an idle limited kind costs this
-- one statement per claim, shared by all of them. Each probe stops at its kind's first due row.
-- Paused and limited queues are left out but for held_queue (inside claim_queue_limited's transaction).
SELECT k.kind
FROM unnest(%(limited)s::text[]) AS k(kind)
WHERE EXISTS (
  SELECT 1 FROM {schema}.jobs j
  WHERE j.kind = k.kind AND j.status = 'pending' AND j.run_after <= now()
    AND (%(queues)s::text[] IS NULL OR j.queue = ANY(%(queues)s::text[]))
    AND (CASE WHEN j.queue = ANY(ARRAY(SELECT queue FROM {schema}.queue_settings
                                       WHERE (paused OR concurrency IS NOT NULL) AND queue IS DISTINCT FROM %(held_queue)s))
              THEN NULL ELSE 1 END) IS NOT NULL);

-- name: limited_queues_due
-- Which of the queues with a concurrency have a due job: the limited queue's claim (a transaction
-- under the queue's row lock) runs only for these. Each probe is the first row of the queue's part
-- of the pending index on (queue, run_after).
SELECT q.queue
FROM unnest(%(queues)s::text[]) AS q(queue)
WHERE EXISTS (
  SELECT 1 FROM {schema}.jobs j
  WHERE j.queue = q.queue AND j.status = 'pending' AND j.run_after <= now());

-- name: kind_limit_wait
-- A limited kind's claim, first statement: bound how long it waits for the kind's row (lock_timeout,
-- this transaction only; `old` is what to put back after, for a caller's own transaction). A wait
-- that runs out skips the kind this pass: a claim never hangs on a lock, and a drain that waits
-- still honours SIGTERM within the bound (issue 25 item 7).
SELECT current_setting('lock_timeout') AS old, set_config('lock_timeout', %(timeout)s, true);

-- name: kind_limit_lock
-- A limited kind's claim, second statement: lock the kind's kind_limits row (inserted the first
-- time; a no-op update of an existing row is the lock), so that claims of this kind by all drainers
-- on all hosts take turns. A row of fleetless's own table: only roles with rights on it can hold it.
-- It is its own statement because under READ COMMITTED each statement reads a snapshot taken when
-- it starts: claim_limited, which follows, then sees every running row and start that the previous
-- holder committed. Locked inside one statement, the count could miss them.
INSERT INTO {schema}.kind_limits AS k (kind) VALUES (%(kind)s)
ON CONFLICT (kind) DO UPDATE SET kind = k.kind;

-- name: kind_limit_unwait
-- A limited kind's claim, last statement: lock_timeout back to what it was (kind_limit_wait).
SELECT set_config('lock_timeout', %(old)s, true);

-- name: claim_limited
-- A limited kind's claim, under kind_limit_lock (its kind_limits row): up to n due jobs of the
-- kind, no more than its concurrency minus its running rows (every drainer's, from the table) and its rate minus the
-- starts in the window before now (kind_starts). The starts it makes are logged at one clock time
-- (also the jobs' started_at, so job_attempts shows them), later than every start the previous
-- lock holder logged; so no window of the rate's length ever holds more than its count. Rows the
-- window has passed are deleted here. Otherwise the same row changes as claim.
-- Paused and concurrency-limited queues are left out, but for held_queue: the limited queue whose
-- row claim_queue_limited holds (then queues is that one queue, and queue_concurrency its limit,
-- counted here against its running rows; NULL for both otherwise).
WITH t AS (
  SELECT clock_timestamp() AS at
), room AS (
  SELECT GREATEST(LEAST(
    %(n)s::int,
    COALESCE(%(concurrency)s::int - (SELECT count(*) FROM {schema}.jobs
                                     WHERE kind = %(kind)s AND status = 'running'), %(n)s::int),
    COALESCE(%(rate)s::int - (SELECT count(*) FROM {schema}.kind_starts s, t
                              WHERE s.kind = %(kind)s
                                AND s.started_at > t.at - make_interval(secs => %(window)s::float8)),
             %(n)s::int),
    COALESCE(%(queue_concurrency)s::int - (SELECT count(*) FROM {schema}.jobs
                                           WHERE queue = %(held_queue)s AND status = 'running'), %(n)s::int)), 0) AS n
), claimed AS (
  UPDATE {schema}.jobs AS j
  SET status = 'running',
      attempts = j.attempts + 1,
      claim_token = %(token)s,
      locked_at = t.at,
      started_at = t.at,
      finished_at = NULL,
      claimed_by = %(claimed_by)s,
      tier = COALESCE(%(kinds)s::jsonb -> j.kind ->> 'tier', %(tier)s),
      max_attempts = CASE WHEN j.max_attempts_default
                          THEN GREATEST(COALESCE((%(kinds)s::jsonb -> j.kind ->> 'max_attempts')::int, 3),
                                        j.attempts + 1)
                          ELSE j.max_attempts END,
      lease_expires_at = t.at + make_interval(
          secs => LEAST(COALESCE(j.timeout_seconds, %(default_timeout)s::float8), %(ttl)s::float8) + %(grace)s::float8)
  FROM t
  WHERE j.id IN (
    SELECT id FROM {schema}.jobs
    WHERE status = 'pending' AND run_after <= now() AND kind = %(kind)s
      AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
      AND (CASE WHEN queue = ANY(ARRAY(SELECT queue FROM {schema}.queue_settings
                                       WHERE (paused OR concurrency IS NOT NULL) AND queue IS DISTINCT FROM %(held_queue)s))
                THEN NULL ELSE 1 END) IS NOT NULL
    ORDER BY priority DESC, run_after
    FOR UPDATE SKIP LOCKED
    LIMIT (SELECT n FROM room)
  )
  RETURNING j.id, j.kind, j.payload::text AS payload_json, j.attempts, j.max_attempts, j.claim_token,
            j.timeout_seconds, j.queue, j.priority,
            extract(epoch FROM j.lease_expires_at - t.at)::float8 AS lease_seconds, j.snoozes, j.releases
), logged AS (
  INSERT INTO {schema}.kind_starts (kind, started_at)
  SELECT %(kind)s, t.at FROM claimed, t WHERE %(rate)s::int IS NOT NULL
), forgotten AS (
  DELETE FROM {schema}.kind_starts s USING t
  WHERE s.kind = %(kind)s AND s.started_at <= t.at - make_interval(secs => %(window)s::float8)
)
SELECT * FROM claimed;

-- name: queue_settings_set
-- `fleetless queue pause|resume|set`, the dashboard: change one queue's row (made the first time).
-- NULL leaves a setting as it is (set_concurrency false: concurrency as it is). The NOTIFY (the
-- queue's name, as an enqueue's) wakes watchers in the same transaction: a resumed queue's due
-- jobs start at once, not at a poll; a watcher woken by a pause claims once and finds nothing.
INSERT INTO {schema}.queue_settings AS s (queue, paused, concurrency)
VALUES (%(queue)s, COALESCE(%(paused)s, false), CASE WHEN %(set_concurrency)s THEN %(concurrency)s::int END)
ON CONFLICT (queue) DO UPDATE
SET paused = COALESCE(%(paused)s, s.paused),
    concurrency = CASE WHEN %(set_concurrency)s THEN %(concurrency)s::int ELSE s.concurrency END,
    updated_at = now()
RETURNING queue, paused, concurrency, pg_notify(%(channel)s, queue);

-- name: queue_settings_remove
-- `fleetless queue remove`: forget one queue's row (a typo's pause or limit), as if never set: its
-- jobs, if any, run as any queue's. The NOTIFY wakes watchers for a queue that was paused.
DELETE FROM {schema}.queue_settings WHERE queue = %(queue)s
RETURNING queue, pg_notify(%(channel)s, queue);

-- name: queue_limits
-- The queues with a concurrency (not paused): a drainer claims these apart (claim_queue_limited).
-- Read again at most once a second (Queue.QUEUE_LIMITS_TTL); the plain claim leaves them out by
-- itself, so a drainer that has not read a new limit yet only waits to claim that queue.
SELECT queue, concurrency FROM {schema}.queue_settings WHERE concurrency IS NOT NULL AND NOT paused;

-- name: queue_list
-- `fleetless queue list`, the dashboard's queues: every queue that has jobs (job_counts, a few
-- rows whatever the table's size) or settings, with its counts by status, paused and concurrency.
SELECT COALESCE(c.queue, s.queue) AS queue, COALESCE(s.paused, false) AS paused, s.concurrency,
       COALESCE(c.pending, 0) AS pending, COALESCE(c.running, 0) AS running, COALESCE(c.done, 0) AS done,
       COALESCE(c.dead, 0) AS dead, COALESCE(c.cancelled, 0) AS cancelled, COALESCE(c.waiting, 0) AS waiting
FROM (SELECT queue,
             sum(n) FILTER (WHERE status = 'pending')::bigint AS pending,
             sum(n) FILTER (WHERE status = 'running')::bigint AS running,
             sum(n) FILTER (WHERE status = 'done')::bigint AS done,
             sum(n) FILTER (WHERE status = 'dead')::bigint AS dead,
             sum(n) FILTER (WHERE status = 'cancelled')::bigint AS cancelled,
             sum(n) FILTER (WHERE status = 'waiting')::bigint AS waiting
      FROM {schema}.job_counts GROUP BY queue HAVING sum(n) <> 0) AS c
FULL JOIN {schema}.queue_settings AS s ON s.queue = c.queue
ORDER BY 1;

-- name: queue_limit_lock
-- A limited queue's claim, second statement (after kind_limit_wait): lock the queue's row, so that
-- claims of the queue by all drainers on all hosts take turns, and read its settings as they are
-- now. Its own statement, as kind_limit_lock: claim_queue_limited, which follows, then sees every
-- running row the previous holder committed. No row, or paused: nothing is claimed.
SELECT paused, concurrency FROM {schema}.queue_settings WHERE queue = %(queue)s FOR UPDATE;

-- name: claim_queue_limited
-- A limited queue's claim, under queue_limit_lock: up to n due jobs of the queue, no more than its
-- concurrency minus its running rows (every drainer's, from the table; NULL: the limit was just
-- removed, n). one_kind (batch mode): all of the kind of the first due job, up to its batch_size,
-- as claim_kind. Kinds with their own limit are in skip_kinds: the caller claims them next in
-- this same transaction under their kind's row too (claim_limited with held_queue), so locks are
-- always taken queue first, then kind. The starts are at the clock time of this statement (as in
-- claim_limited), after every finish the count saw: the history never shows more than the
-- concurrency at once. Otherwise the same row changes as claim.
WITH t AS (
  SELECT clock_timestamp() AS at
), room AS (
  SELECT GREATEST(LEAST(%(n)s::int,
                        COALESCE(%(concurrency)s::int - (SELECT count(*) FROM {schema}.jobs
                                                         WHERE queue = %(queue)s AND status = 'running'),
                                 %(n)s::int)), 0) AS n
), head AS (
  SELECT kind FROM {schema}.jobs
  WHERE status = 'pending' AND run_after <= now() AND queue = %(queue)s
    AND (%(skip_kinds)s::text[] IS NULL OR kind <> ALL(%(skip_kinds)s::text[]))
  ORDER BY priority DESC, run_after
  LIMIT 1
), claimed AS (
UPDATE {schema}.jobs AS j
SET status = 'running',
    attempts = j.attempts + 1,
    claim_token = %(token)s,
    locked_at = t.at,
    started_at = t.at,
    finished_at = NULL,
    claimed_by = %(claimed_by)s,
    tier = COALESCE(%(kinds)s::jsonb -> j.kind ->> 'tier', %(tier)s),
    max_attempts = CASE WHEN j.max_attempts_default
                        THEN GREATEST(COALESCE((%(kinds)s::jsonb -> j.kind ->> 'max_attempts')::int, 3),
                                      j.attempts + 1)
                        ELSE j.max_attempts END,
    lease_expires_at = t.at + make_interval(
        secs => LEAST(COALESCE(j.timeout_seconds, %(default_timeout)s::float8), %(ttl)s::float8) + %(grace)s::float8)
FROM t
WHERE j.id = ANY(ARRAY(
  SELECT id FROM {schema}.jobs
  WHERE status = 'pending' AND run_after <= now() AND queue = %(queue)s
    AND (%(skip_kinds)s::text[] IS NULL OR kind <> ALL(%(skip_kinds)s::text[]))
    AND (NOT %(one_kind)s OR kind = (SELECT kind FROM head))
  ORDER BY priority DESC, run_after
  FOR UPDATE SKIP LOCKED
  LIMIT CASE WHEN %(one_kind)s
             THEN LEAST((SELECT n FROM room),
                        COALESCE((%(kinds)s::jsonb -> (SELECT kind FROM head) ->> 'batch_size')::int, %(n)s::int))
             ELSE (SELECT n FROM room) END
))
RETURNING j.id, j.kind, j.payload::text AS payload_json, j.attempts, j.max_attempts, j.claim_token,
          j.timeout_seconds, j.queue, j.priority,
          extract(epoch FROM j.lease_expires_at - t.at)::float8 AS lease_seconds, j.snoozes, j.releases
)
SELECT * FROM claimed ORDER BY priority DESC, id;

-- name: listen
-- Watch mode: enqueue NOTIFYs this channel ({channel}: the queue's, quoted) in its transaction.
LISTEN {channel};

-- name: watcher_take
-- Watch mode: one watcher per schema and set of queues, the row of the set in watchers. Taken
-- when free, when this watcher holds it already (a reconnect), or when the holder's heartbeat is
-- older than the lease it declared (it is stopped, hung or gone). A row (not an advisory key):
-- only roles with rights on the table can hold it. The cron tick that finds it held exits after
-- this one query. No row returned: another watcher is alive.
INSERT INTO {schema}.watchers AS w (queues, holder, heartbeat_at, lease_seconds)
VALUES (%(queues)s, %(holder)s, now(), %(lease)s)
ON CONFLICT (queues) DO UPDATE
SET holder = EXCLUDED.holder, heartbeat_at = EXCLUDED.heartbeat_at, lease_seconds = EXCLUDED.lease_seconds
WHERE w.holder = EXCLUDED.holder OR w.heartbeat_at < now() - make_interval(secs => w.lease_seconds)
RETURNING true AS got;

-- name: watcher_beat
-- Watch mode: the holder renews its heartbeat every few seconds. No row: another watcher took the
-- set over (this one's heartbeat had expired); this one then stops claiming.
UPDATE {schema}.watchers SET heartbeat_at = now()
WHERE queues = %(queues)s AND holder = %(holder)s
RETURNING true AS held;

-- name: watcher_release
-- Watch mode: a watcher that exits frees its set at once (the next tick need not wait a lease).
DELETE FROM {schema}.watchers WHERE queues = %(queues)s AND holder = %(holder)s;

-- name: watcher_lock_timeout
-- The watcher's own connection: whoever holds a row it writes, it waits at most this long.
SET lock_timeout = '2s';

-- name: next_due
-- Watch mode sleeps until the next pending job of its queues is due (not a poll every second);
-- seconds from now, or NULL when nothing is pending. Kinds the drain does not claim (skip_kinds)
-- do not wake it. Without skip_kinds: named queues, each one's first row of the pending index on
-- (queue, run_after), so a queue with nothing due costs a few index reads whatever the backlog of
-- other queues; all queues (NULL): the first row of the pending index on run_after. With them
-- (filtering those indexes by kind read the skipped kinds' whole backlog, issue 26): a skip scan
-- of jobs_kind_claim_idx (migration 020) finds the first row of each (kind, queue, priority) that
-- has pending jobs, one index descent each: the earliest due time of the ones the drain may take.
-- Each branch is gated on skip_kinds, so only one of them runs. Paused queues (queue_settings) do
-- not wake it either: while some queue is paused, all queues (NULL) without skip_kinds are each
-- unpaused queue's first row as for named queues (the queues with pending jobs from job_counts),
-- so a paused backlog is never read through.
WITH RECURSIVE paused AS (
  SELECT ARRAY(SELECT queue FROM {schema}.queue_settings WHERE paused) AS queues
), part AS (
  (SELECT kind, queue, priority, run_after FROM {schema}.jobs
   WHERE status = 'pending' AND %(skip_kinds)s::text[] IS NOT NULL
   ORDER BY kind, queue, priority DESC, run_after LIMIT 1)
  UNION ALL
  SELECT nx.* FROM part p CROSS JOIN LATERAL (
    (SELECT kind, queue, priority, run_after FROM {schema}.jobs
     WHERE status = 'pending' AND kind = p.kind AND queue = p.queue AND priority < p.priority
     ORDER BY priority DESC, run_after LIMIT 1)
    UNION ALL
    (SELECT kind, queue, priority, run_after FROM {schema}.jobs
     WHERE status = 'pending' AND (kind, queue) > (p.kind, p.queue)
     ORDER BY kind, queue, priority DESC, run_after LIMIT 1)
    LIMIT 1) AS nx
)
SELECT extract(epoch FROM min(due.run_after) - now())::float8 AS seconds
FROM (
  SELECT (SELECT j.run_after FROM {schema}.jobs AS j
          WHERE j.status = 'pending' AND j.queue = q.queue
          ORDER BY j.run_after LIMIT 1) AS run_after
  FROM paused, (SELECT queue FROM unnest(%(queues)s::text[]) AS queue
                UNION ALL
                SELECT queue FROM {schema}.job_counts, paused
                WHERE %(queues)s::text[] IS NULL AND cardinality(paused.queues) > 0 AND status = 'pending'
                GROUP BY queue HAVING sum(n) > 0) AS q(queue)
  WHERE %(skip_kinds)s::text[] IS NULL AND q.queue <> ALL(paused.queues)
  UNION ALL
  SELECT (SELECT j.run_after FROM {schema}.jobs AS j
          WHERE j.status = 'pending'
          ORDER BY j.run_after LIMIT 1)
  FROM paused
  WHERE %(queues)s::text[] IS NULL AND %(skip_kinds)s::text[] IS NULL AND cardinality(paused.queues) = 0
  UNION ALL
  SELECT p.run_after FROM part p, paused
  WHERE p.kind <> ALL(%(skip_kinds)s::text[])
    AND (%(queues)s::text[] IS NULL OR p.queue = ANY(%(queues)s::text[]))
    AND p.queue <> ALL(paused.queues)
) AS due;

-- The read service (fleetless.insights): what the CLI's reports, the dashboard and /metrics show.

-- name: insight_counts
-- Jobs by queue, kind and status for the live ones (pending, running), by kind and status for the
-- finished ones (queue NULL), as before; read from job_counts (migration 016), a few rows whatever
-- the table's size, never from the jobs table.
SELECT CASE WHEN status IN ('pending', 'running') THEN queue END AS queue, kind, status,
       sum(n)::bigint AS n
FROM {schema}.job_counts
GROUP BY 1, kind, status HAVING sum(n) <> 0;

-- name: insight_counts_by_queue
-- The dashboard's "By queue" table: every status of every queue that has jobs (finished ones too),
-- from job_counts: a few rows whatever the table's size.
SELECT queue, status, sum(n)::bigint AS n
FROM {schema}.job_counts
GROUP BY queue, status HAVING sum(n) <> 0;

-- name: insight_oldest_due_by_queue
-- How long the oldest due job of each queue has waited (a drainer is not keeping up, or not
-- running). The queues with pending jobs come from job_counts; each one's oldest is the first row
-- of its part of the pending index on (queue, run_after): a few index reads per queue, not a read
-- of every due job (1M at scale).
SELECT q.queue, extract(epoch FROM now() - m.run_after)::float8 AS age_seconds
FROM (SELECT queue FROM {schema}.job_counts WHERE status = 'pending'
      GROUP BY queue HAVING sum(n) > 0) AS q
CROSS JOIN LATERAL (SELECT min(run_after) AS run_after FROM {schema}.jobs
                    WHERE status = 'pending' AND queue = q.queue) AS m
WHERE m.run_after <= now()
ORDER BY q.queue;

-- name: insight_running
-- What runs now, longest first, with the drainer holding it (claimed_by, tier), a page at a time
-- (%(limit)s is one more than the page, to know whether another follows). Running rows are few and
-- the lease index covers them.
SELECT id, kind, queue, attempts, max_attempts, started_at, lease_expires_at, claimed_by, tier,
       extract(epoch FROM now() - started_at)::float8 AS elapsed_seconds
FROM {schema}.jobs WHERE status = 'running'
ORDER BY started_at NULLS LAST, id
LIMIT %(limit)s OFFSET %(offset)s;

-- name: insight_attempts
-- The job page: a page of one job's attempt history, oldest first, through job_attempts_job_idx.
-- 'retry' reads as 'failed', as in attempts.
SELECT attempt, CASE outcome WHEN 'retry' THEN 'failed' ELSE outcome END AS outcome, snooze, host, pid, tier,
       started_at, finished_at, exit_code, signal, kill_reason, duration_seconds, error_head
FROM {schema}.job_attempts WHERE job_id = %(id)s ORDER BY id
LIMIT %(limit)s OFFSET %(offset)s;

-- name: insight_attempt_runs
-- The job page: a page of one job's attempt history, oldest first, each run of consecutive snoozes
-- folded into one row (its first row's columns, n, the run's span and its rows for a <details>): a
-- job at the snooze cap listed 100 snooze rows around the attempts that matter (issue 28). Islands
-- by the difference of two row numbers; one job's history, through job_attempts_job_idx.
WITH a AS (
  SELECT id, attempt, CASE outcome WHEN 'retry' THEN 'failed' ELSE outcome END AS outcome, snooze, host, pid,
         tier, started_at, finished_at, exit_code, signal, kill_reason, duration_seconds, error_head,
         row_number() OVER (ORDER BY id) - row_number() OVER (PARTITION BY outcome = 'snoozed' ORDER BY id) AS island
  FROM {schema}.job_attempts WHERE job_id = %(id)s
), g AS (
  SELECT min(id) AS first_id, count(*) AS n, min(started_at) AS run_started, max(finished_at) AS run_finished,
         CASE WHEN count(*) > 1 THEN jsonb_agg(jsonb_build_object('snooze', snooze, 'finished_at', finished_at,
                                                                  'error_head', error_head) ORDER BY id) END AS run
  FROM a GROUP BY outcome = 'snoozed', CASE WHEN outcome = 'snoozed' THEN island ELSE id END
)
SELECT a.attempt, a.outcome, a.snooze, a.host, a.pid, a.tier, a.started_at, a.finished_at, a.exit_code, a.signal,
       a.kill_reason, a.duration_seconds, a.error_head, g.n, g.run_started, g.run_finished, g.run
FROM g JOIN a ON a.id = g.first_id ORDER BY g.first_id
LIMIT %(limit)s OFFSET %(offset)s;

-- name: insight_per_minute
-- Attempts that ended per minute over the last %(minutes)s minutes, every minute present (zeros
-- too): done, and failed (failed, retried by its handler, dead, or expired with the lease; 'retry'
-- from before migration 024), counted from the attempt history so a job that failed three times
-- shows three failures, not one dead row (a discard is a failure too). Released, snoozed and cancelled attempts are neither. Reads only the window through
-- job_attempts_finished_idx, whatever the history's size.
WITH f AS (
  SELECT date_trunc('minute', finished_at) AS minute,
         count(*) FILTER (WHERE outcome = 'done') AS done,
         count(*) FILTER (WHERE outcome IN ('failed', 'retried', 'retry', 'dead', 'expired', 'discarded')) AS failed
  FROM {schema}.job_attempts
  WHERE finished_at >= date_trunc('minute', now()) - make_interval(mins => %(minutes)s - 1)
  GROUP BY 1
)
SELECT m.minute, COALESCE(f.done, 0) AS done, COALESCE(f.failed, 0) AS failed
FROM generate_series(date_trunc('minute', now()) - make_interval(mins => %(minutes)s - 1),
                     date_trunc('minute', now()), interval '1 minute') AS m(minute)
LEFT JOIN f USING (minute)
ORDER BY m.minute;

-- name: attempt_totals_mark
SELECT last_id FROM {schema}.attempt_totals_mark;

-- name: attempt_fold_upto
-- /metrics: how far the next fold may go: the newest attempt that ended %(margin)s seconds ago or
-- more. An attempt is written by one short statement, so by then every smaller id is committed and
-- visible, and the fold skips none. At most %(batch)s past the mark, so each scrape stays short
-- while a long history is folded in; only that range of the key is read (from its end back to
-- the first old enough). No row: nothing to fold.
SELECT max(id) AS upto
FROM {schema}.job_attempts
WHERE id > %(after)s AND id <= %(after)s::bigint + %(batch)s::bigint
  AND finished_at < now() - make_interval(secs => %(margin)s)
HAVING max(id) IS NOT NULL;

-- name: fold_attempt_totals
-- /metrics: add the attempts after the mark up to %(upto)s to attempt_totals, so each scrape reads
-- the totals plus a short tail of job_attempts, never the whole history. One folder at a time (the
-- mark's row lock, skipped when held), and only while the mark is still %(after)s, the value the
-- caller read (a concurrent scrape that folded first wins; this one then changes nothing). Both ends are passed as values
-- and the caller runs it unprepared, so the planner sees how many attempts are in the range (with
-- a subquery or a generic plan it guesses a third of the table, joins the whole jobs table and
-- JIT-compiles for a second). A job pruned before any fold counts under the kind "(pruned)". The
-- bucket: width_bucket over the negated, reversed bounds counts the bounds >= the duration, which
-- picks the smallest of them (exact at a bound, as Prometheus's "le"). The kind: by the job's key,
-- one lookup per attempt (a join was planned as a hash of the whole jobs table, 10 s a step).
WITH mark AS (
  SELECT last_id FROM {schema}.attempt_totals_mark
  WHERE last_id = %(after)s
  FOR UPDATE SKIP LOCKED
), folded AS (
  SELECT COALESCE((SELECT j.kind FROM {schema}.jobs j WHERE j.id = a.job_id), '(pruned)') AS kind,
         CASE a.outcome WHEN 'retry' THEN 'failed' ELSE a.outcome END AS outcome,
         CASE WHEN a.duration_seconds IS NULL THEN -1
              ELSE COALESCE((%(bounds)s::float8[])[cardinality(%(bounds)s::float8[]) + 1
                            - width_bucket(-a.duration_seconds, %(negated)s::float8[])], 'Infinity') END AS bound,
         count(*) AS n, COALESCE(sum(a.duration_seconds), 0) AS seconds
  FROM {schema}.job_attempts a
  WHERE a.id > %(after)s AND a.id <= %(upto)s AND EXISTS (SELECT FROM mark)
  GROUP BY 1, 2, 3
), added AS (
  INSERT INTO {schema}.attempt_totals AS t (kind, outcome, bound, n, seconds)
  SELECT kind, outcome, bound, n, seconds FROM folded
  ON CONFLICT (kind, outcome, bound)
  DO UPDATE SET n = t.n + EXCLUDED.n, seconds = t.seconds + EXCLUDED.seconds
)
UPDATE {schema}.attempt_totals_mark SET last_id = %(upto)s
WHERE EXISTS (SELECT FROM mark)
RETURNING last_id;

-- name: attempt_totals
-- /metrics: ended attempts by kind, outcome and duration bucket: the folded totals plus the
-- attempts after the mark %(after)s the caller read, at most %(tail)s ids past it (a range of the
-- primary key: an unfolded history of millions cost 4-15 s a scrape, issue 26; the rest is
-- counted once folds move the mark on). Each row also carries the mark as this statement saw
-- it: if a fold moved it in between, the caller reads again (else it would count the attempts
-- that fold added twice). Each attempt's kind is looked up by its job's key, one row each (a
-- join was planned as a hash of the whole jobs table: 10 s for 50,000 attempts beside 6M jobs).
SELECT kind, outcome, bound, sum(n)::bigint AS n, sum(seconds)::float8 AS seconds,
       (SELECT last_id FROM {schema}.attempt_totals_mark) AS mark
FROM (
  -- 'retry' (totals folded before migration 024) counts as 'failed', as every read of the history
  SELECT kind, CASE outcome WHEN 'retry' THEN 'failed' ELSE outcome END AS outcome, bound, n, seconds
  FROM {schema}.attempt_totals
  UNION ALL
  SELECT COALESCE((SELECT j.kind FROM {schema}.jobs j WHERE j.id = a.job_id), '(pruned)'),
         CASE a.outcome WHEN 'retry' THEN 'failed' ELSE a.outcome END,
         CASE WHEN a.duration_seconds IS NULL THEN -1
              ELSE COALESCE((%(bounds)s::float8[])[cardinality(%(bounds)s::float8[]) + 1
                            - width_bucket(-a.duration_seconds, %(negated)s::float8[])], 'Infinity') END,
         1, COALESCE(a.duration_seconds, 0)
  FROM {schema}.job_attempts a
  WHERE a.id > %(after)s AND a.id <= %(after)s::bigint + %(tail)s::bigint
) AS t
GROUP BY kind, outcome, bound
ORDER BY kind, outcome, bound;

-- name: run_now
-- Operator "run now" of a pending job that is scheduled later (or backing off): due now. It
-- NOTIFYs the job's queue as an enqueue does, so an idle watcher starts it at once.
UPDATE {schema}.jobs SET run_after = now()
WHERE id = %(id)s AND status = 'pending'
RETURNING id, pg_notify(%(channel)s, queue);

-- name: schedule_add
-- Add a schedule, or change one of the same name (its enqueued occurrences stay recorded). The
-- NOTIFY (payload: SCHEDULES_CHANGED, which no queue name can be) wakes every watcher in the same
-- transaction: it runs a scheduler pass and sleeps until the new next occurrence, instead of
-- learning of the schedule at its next maintenance pass, up to a minute or more late (issue 26
-- item 7). A schedule stored again as it is (every drain stores fleetless.toml's) writes nothing
-- and wakes nobody: no row comes back.
INSERT INTO {schema}.schedules AS s (name, cron, timezone, kind, payload, queue, max_attempts, priority,
                                     timeout_seconds)
VALUES (%(name)s, %(cron)s, %(timezone)s, %(kind)s, %(payload)s, %(queue)s, %(max_attempts)s,
        %(priority)s, %(timeout)s)
ON CONFLICT (name) DO UPDATE SET cron = EXCLUDED.cron, timezone = EXCLUDED.timezone, kind = EXCLUDED.kind,
  payload = EXCLUDED.payload, queue = EXCLUDED.queue, max_attempts = EXCLUDED.max_attempts,
  priority = EXCLUDED.priority, timeout_seconds = EXCLUDED.timeout_seconds
WHERE (s.cron, s.timezone, s.kind, s.payload, s.queue, s.max_attempts, s.priority, s.timeout_seconds)
      IS DISTINCT FROM (EXCLUDED.cron, EXCLUDED.timezone, EXCLUDED.kind, EXCLUDED.payload, EXCLUDED.queue,
                        EXCLUDED.max_attempts, EXCLUDED.priority, EXCLUDED.timeout_seconds)
RETURNING (xmax = 0) AS created, pg_notify(%(channel)s, %(schedules_changed)s);

-- name: schedule_remove
-- The NOTIFY wakes watchers as in schedule_add: the next wake they computed may be this one's.
DELETE FROM {schema}.schedules WHERE name = %(name)s RETURNING name, pg_notify(%(channel)s, %(schedules_changed)s);

-- name: schedules
-- Every schedule with its latest enqueued occurrence (where catch-up starts) and the database's
-- clock (the one every drainer shares). One query: a drain with no schedules pays only this.
SELECT s.name, s.cron, s.timezone, s.kind, s.payload, s.queue, s.max_attempts, s.priority,
       s.timeout_seconds, s.created_at,
       (SELECT max(t.tick) FROM {schema}.schedule_ticks t WHERE t.schedule = s.name) AS last_tick,
       now() AS now
FROM {schema}.schedules s
ORDER BY s.name;

-- name: enqueue_ticks
-- The scheduler: record each due occurrence and enqueue its job, in one statement. A (schedule,
-- tick) another drainer recorded first conflicts and enqueues nothing here, so each occurrence
-- becomes exactly one job however many drainers race. The job is due at its tick. Occurrences
-- older than the catch-up window are never enqueued again, so their rows are dropped here too.
-- A schedule without max_attempts (NULL) enqueues as enqueue without one: 3, and the claim applies
-- the kind's. Only schedules that still exist get ticks: FOR KEY SHARE waits for a concurrent
-- schedule_remove and then leaves its schedule out (instead of a foreign-key violation that lost
-- every other schedule's ticks and crashed the drain), and keeps the rest from being removed
-- until this commits.
WITH due AS (
  SELECT d.schedule, d.tick
  FROM unnest(%(names)s::text[], %(ticks)s::timestamptz[]) AS d(schedule, tick)
  JOIN {schema}.schedules s ON s.name = d.schedule
  FOR KEY SHARE OF s
), won AS (
  INSERT INTO {schema}.schedule_ticks (schedule, tick)
  SELECT schedule, tick FROM due
  ON CONFLICT DO NOTHING
  RETURNING schedule, tick
), jobs AS (
  INSERT INTO {schema}.jobs (kind, payload, max_attempts, run_after, queue, priority, timeout_seconds,
                             max_attempts_default)
  SELECT s.kind, s.payload, COALESCE(s.max_attempts, 3), w.tick, s.queue, s.priority, s.timeout_seconds,
         s.max_attempts IS NULL
  FROM won w JOIN {schema}.schedules s ON s.name = w.schedule
  RETURNING id, queue
), notified AS (
  SELECT count(*) AS n, count(pg_notify(%(channel)s, queue)) FROM jobs
), forgotten AS (
  DELETE FROM {schema}.schedule_ticks WHERE tick < %(forget_before)s
)
SELECT n FROM notified;
