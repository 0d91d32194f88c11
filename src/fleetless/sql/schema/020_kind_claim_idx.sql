-- Claims and next_due of a drain that skips kinds (every kind with a concurrency or rate limit,
-- claimed apart, and the kinds it cannot run) stay cheap beside a large backlog of the skipped
-- kinds (issue 26: 0.6-1.06 s at 1M pending, the claim index's order filtered by kind read every
-- due row of theirs). This index lets them find each (kind, queue) with pending jobs by a skip
-- scan, one descent each, and read only the first rows, in claim order, of the ones they take.
CREATE INDEX IF NOT EXISTS jobs_kind_claim_idx ON {schema}.jobs (kind, queue, priority DESC, run_after)
  WHERE status = 'pending';
