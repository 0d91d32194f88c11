-- Cancelling a running job: the operator's request is a mark on the row; the drainer holding the
-- job sees it, kills the sandbox, and the attempt's end turns into cancelled (no further attempt).
ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS cancel_requested_at timestamptz;
