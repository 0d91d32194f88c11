-- Periodic jobs. A schedule is a cron expression in a time zone and the job it enqueues; each
-- drain enqueues the occurrences that came due. schedule_ticks makes that exactly once per
-- occurrence whatever the number of drainers racing: an occurrence's job is inserted only by the
-- statement whose (schedule, tick) row got in. No leader, no lock held across drains.
CREATE TABLE IF NOT EXISTS {schema}.schedules (
  name            text        PRIMARY KEY,
  cron            text        NOT NULL,
  timezone        text        NOT NULL DEFAULT 'UTC',
  kind            text        NOT NULL,
  payload         jsonb       NOT NULL,
  queue           text        NOT NULL DEFAULT 'default',
  max_attempts    int         NOT NULL DEFAULT 3,
  priority        int         NOT NULL DEFAULT 0,
  timeout_seconds int,
  created_at      timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT schedules_name_check CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$'),
  CONSTRAINT schedules_kind_check CHECK (kind ~ '^[a-z0-9][a-z0-9_.-]{0,63}$' AND strpos(kind, '..') = 0),
  CONSTRAINT schedules_max_attempts_check CHECK (max_attempts BETWEEN 1 AND 1000)
);

CREATE TABLE IF NOT EXISTS {schema}.schedule_ticks (
  schedule text        NOT NULL REFERENCES {schema}.schedules (name) ON DELETE CASCADE,
  tick     timestamptz NOT NULL,
  PRIMARY KEY (schedule, tick)
);
