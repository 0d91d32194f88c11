-- 1M pending; 4M finished outside graphs over the last 10 days; 1M finished in 100 graphs of 10,000,
-- the oldest rows (10-11 days, older than every other finished row), each graph holding one waiting job (worst case: every graph held)
INSERT INTO fleetless.jobs (kind, payload, queue, status, attempts, started_at, finished_at, graph_id)
SELECT 'k' || (i % 20), '{}', 'backlog', 'done', 1,
       now() - interval '11 days' + make_interval(secs => i * 0.0864) - interval '1 second',
       now() - interval '11 days' + make_interval(secs => i * 0.0864),
       ((i - 1) / 10000) * 10000 + 1
FROM generate_series(1, 1000000) i;
INSERT INTO fleetless.jobs (kind, payload, queue, status, graph_id)
SELECT 'k1', '{}', 'backlog', 'waiting', g * 10000 + 1 FROM generate_series(0, 99) g;
INSERT INTO fleetless.jobs (kind, payload, queue, status, attempts, started_at, finished_at)
SELECT 'k' || (i % 20), '{}', 'backlog',
       CASE WHEN i % 20 < 16 THEN 'done' WHEN i % 20 < 19 THEN 'dead' ELSE 'cancelled' END, 1,
       now() - make_interval(secs => i * 864000.0 / 4000000) - interval '1 second',
       now() - make_interval(secs => i * 864000.0 / 4000000)
FROM generate_series(1, 4000000) i;
INSERT INTO fleetless.jobs (kind, payload, queue, run_after)
SELECT 'k' || (i % 20), '{}', 'backlog', now() - make_interval(secs => (i % 3600)::float8)
FROM generate_series(1, 1000000) i;
VACUUM ANALYZE fleetless.jobs;
SELECT status, count(*), count(graph_id) FROM fleetless.jobs GROUP BY 1;
