-- Per-kind settings applied by the claim (fleetless.toml, docs/operations.md).

-- A job enqueued without its own max_attempts: the drain that claims it applies its kind's
-- max_attempts (else the 3 stored here stays). false: the enqueuer chose it (and raw INSERTs that
-- do not name this column keep the max_attempts they wrote, as before).
ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS max_attempts_default boolean NOT NULL DEFAULT false;

-- A kind's rate limit (rate = "100/min"): when each of its recent jobs was claimed. A limited
-- claim counts the rows of its kind inside the window, under the kind's advisory lock, adds one
-- row per job it claims and deletes the rows the window has left behind, so the table holds at
-- most about one window's worth of claims per rate-limited kind.
CREATE TABLE IF NOT EXISTS {schema}.kind_starts (
  kind       text        NOT NULL,
  started_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS kind_starts_kind_idx ON {schema}.kind_starts (kind, started_at);
