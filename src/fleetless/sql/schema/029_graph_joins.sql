-- Workflows (issue 29): an enqueue whose child joins two or more graphs relabels the larger-labelled
-- ones (graph_relabel), rewriting their jobs, while other enqueues hold FOR SHARE locks on jobs of
-- them (graph_labels). Two joins of the same graphs at once each held a share lock on a job the
-- other rewrote: a deadlock, which PostgreSQL broke by aborting one of them. A join first locks
-- the rows here of every graph it joins, FOR UPDATE in slot order, so two joins of a common graph
-- take turns and never wait for each other in a circle; an enqueue that joins nothing never reads
-- this table. A graph's slot is its label modulo the rows here (fleetless.graphs.JOIN_SLOTS): a
-- fixed table, nothing to insert or prune; two graphs that share a slot only make their joins
-- take turns. A row of fleetless's own table, not an advisory key that any role able to connect
-- could hold (issue 25 item 7).
CREATE TABLE IF NOT EXISTS {schema}.graph_joins (
  slot int PRIMARY KEY
);
INSERT INTO {schema}.graph_joins (slot) SELECT generate_series(0, 1023) ON CONFLICT DO NOTHING;
