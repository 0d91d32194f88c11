-- Releases since the job was last charged an attempt. A release (drainer stopping, sandbox broken)
-- gives the attempt back; a job whose sandbox breaks every time would otherwise block its queue
-- forever, so every MAX_RELEASES-th release in a row is charged as a failed attempt (queue.py).
ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS releases int NOT NULL DEFAULT 0;
