-- Workflows (issue 29): retention prunes a graph as a whole. graph_id labels the connected graph
-- of jobs (parents and children, in either direction) a job belongs to: the smallest id among its
-- jobs and those of the graphs merged into it. NULL: the job was never a parent nor a child. An
-- enqueue with parents sets it on every job of the call's graphs and relabels, in the same
-- transaction, the existing graphs a new child joins together (fleetless.graphs), so retention
-- asks one question per finished job: does any job of its graph still run, wait, or lie inside its
-- status' retention age? Four probes of the index below, whatever the graph's size (a walk of the
-- graph per row read every job of a 10,000-job graph for each of them).
ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS graph_id bigint;
-- By graph, then status and finish: "a job of graph g still waiting, pending or running" and "a
-- done job of graph g finished after t" are each the first entry of a range. Only graph members
-- are in it, so jobs without workflows cost it nothing.
CREATE INDEX IF NOT EXISTS jobs_graph_idx ON {schema}.jobs (graph_id, status, finished_at)
  WHERE graph_id IS NOT NULL;

-- The graphs written before this migration: each job with an edge takes the smallest id of its
-- graph. Every job starts as its own label; each round every job takes the smallest label of its
-- neighbours, then the label of its label (pointer jumping), so a chain of n jobs takes about
-- log2(n) rounds rather than n.
DO $$
DECLARE
  changed bigint;
BEGIN
  CREATE TEMP TABLE graph_labels ON COMMIT DROP AS
    SELECT id, id AS label FROM (SELECT parent_id AS id FROM {schema}.job_dependencies
                                 UNION SELECT child_id FROM {schema}.job_dependencies) AS s;
  CREATE UNIQUE INDEX ON graph_labels (id);
  LOOP
    UPDATE graph_labels l SET label = n.label
    FROM (SELECT e.id, min(o.label) AS label
          FROM (SELECT parent_id AS id, child_id AS other FROM {schema}.job_dependencies
                UNION ALL SELECT child_id, parent_id FROM {schema}.job_dependencies) AS e
          JOIN graph_labels o ON o.id = e.other
          GROUP BY e.id) AS n
    WHERE l.id = n.id AND n.label < l.label;
    GET DIAGNOSTICS changed = ROW_COUNT;
    UPDATE graph_labels l SET label = x.label FROM graph_labels x WHERE x.id = l.label AND x.label < l.label;
    EXIT WHEN changed = 0;
  END LOOP;
  UPDATE {schema}.jobs j SET graph_id = l.label FROM graph_labels l
  WHERE j.id = l.id AND j.graph_id IS DISTINCT FROM l.label;
END $$;
