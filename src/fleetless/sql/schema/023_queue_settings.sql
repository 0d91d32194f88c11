-- Per-queue settings an operator changes at run time (`fleetless queue pause|resume|set`, the
-- dashboard): one row per queue that has any. No row: the queue is running and unlimited.
-- paused: no claim takes the queue's jobs (they wait, pending; jobs already running finish).
-- concurrency: at most this many of the queue's jobs running at once, across every drainer on
-- every host. A claim of a limited queue locks the queue's row (FOR UPDATE, under a bounded
-- lock_timeout) and counts its running rows, as a limited kind's claim does with kind_limits
-- (migration 015): a row of fleetless's own table, not an advisory lock.
-- The plain claim leaves out every queue with a row here that is paused or limited (an InitPlan
-- over this table, read once per claim: with no row, one probe of an empty table).
CREATE TABLE IF NOT EXISTS {schema}.queue_settings (
  queue       text        PRIMARY KEY,
  paused      boolean     NOT NULL DEFAULT false,
  concurrency int         CHECK (concurrency >= 1),
  updated_at  timestamptz NOT NULL DEFAULT now()
);
