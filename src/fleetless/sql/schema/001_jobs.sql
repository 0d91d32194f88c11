-- The queue is a table. Columns, names and defaults of the seed first, then ours.
-- {schema} is replaced by the quoted schema name (default "fleetless").
CREATE TABLE IF NOT EXISTS {schema}.jobs (
  id           bigserial PRIMARY KEY,
  kind         text        NOT NULL,
  payload      jsonb       NOT NULL,
  status       text        NOT NULL DEFAULT 'pending',
  attempts     int         NOT NULL DEFAULT 0,
  max_attempts int         NOT NULL DEFAULT 3,
  run_after    timestamptz NOT NULL DEFAULT now(),
  locked_at    timestamptz,
  last_error   text,
  created_at   timestamptz NOT NULL DEFAULT now(),
  -- ours
  queue            text        NOT NULL DEFAULT 'default',
  priority         int         NOT NULL DEFAULT 0,       -- higher runs first
  result           text,                                 -- the handler's stdout, capped at 64 KiB
  claim_token      uuid,                                 -- the fence: set by each claim
  timeout_seconds  int,                                  -- NULL: the drainer's --timeout
  started_at       timestamptz,
  finished_at      timestamptz,
  lease_expires_at timestamptz,                          -- past it, the reaper returns the claim
  CONSTRAINT jobs_status_check CHECK (status IN ('pending', 'running', 'done', 'dead', 'cancelled')),
  -- Defence in depth: the kind becomes a file name in the handlers directory.
  CONSTRAINT jobs_kind_check CHECK (kind ~ '^[a-z0-9][a-z0-9_.-]{0,63}$' AND strpos(kind, '..') = 0),
  CONSTRAINT jobs_queue_check CHECK (queue ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$'),
  CONSTRAINT jobs_max_attempts_check CHECK (max_attempts BETWEEN 1 AND 1000),
  CONSTRAINT jobs_attempts_check CHECK (attempts >= 0),
  CONSTRAINT jobs_timeout_check CHECK (timeout_seconds IS NULL OR timeout_seconds > 0)
);

-- The seed's index. Partial, because only pending rows are ever scanned and the table will be
-- mostly completed rows. It serves "what is due next" (status, run_after order).
CREATE INDEX IF NOT EXISTS jobs_claim_idx ON {schema}.jobs (run_after)
  WHERE status = 'pending';

-- The claim's own order (priority first, then due time), also partial on pending rows, so the
-- claim reads due jobs in the order it hands them out and stops after LIMIT rows.
CREATE INDEX IF NOT EXISTS jobs_claim_priority_idx ON {schema}.jobs (priority DESC, run_after)
  WHERE status = 'pending';

-- The reaper looks only at running rows, ordered by lease expiry. Running rows are few.
CREATE INDEX IF NOT EXISTS jobs_lease_idx ON {schema}.jobs (lease_expires_at)
  WHERE status = 'running';

-- Inspection by kind and status (`fleetless jobs --kind`, `status`).
CREATE INDEX IF NOT EXISTS jobs_kind_status_idx ON {schema}.jobs (kind, status);
