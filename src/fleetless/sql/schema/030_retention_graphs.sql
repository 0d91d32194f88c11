-- Retention (issue 29, audit): the jobs of workflow graphs leave the per-status scans. A pass read
-- finished rows oldest first and probed each graph job it met; once the older rows had gone, the
-- jobs of graphs still held (one job waiting) lay at the front of every pass: 1M such rows made a
-- 500-row pass take 2.7-5.6 s. The scans now read this index, which holds finished jobs in no
-- graph only; a graph's jobs go by a graph step of their own (prune_graphs_next, prune_batch),
-- a bounded number of graphs a pass from the cursor below.
CREATE INDEX IF NOT EXISTS jobs_finished_free_idx ON {schema}.jobs (status, finished_at)
  WHERE status IN ('done', 'cancelled', 'dead') AND graph_id IS NULL;
DROP INDEX IF EXISTS {schema}.jobs_finished_status_idx;
-- Where a periodic task left off (retention's graph step: the last graph label it looked at;
-- NULL or 0, from the first). A row of maintenance_runs, so it is kept between runs and drains.
ALTER TABLE {schema}.maintenance_runs ADD COLUMN IF NOT EXISTS position bigint;
