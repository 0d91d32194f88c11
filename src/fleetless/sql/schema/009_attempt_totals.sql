-- Running totals of ended attempts, by kind, outcome and duration bucket, that /metrics reads
-- instead of aggregating every attempt ever made (fleetless.insights folds job_attempts into them
-- at each scrape). They only grow, pruning does not lower them: they are Prometheus counters.
CREATE TABLE IF NOT EXISTS {schema}.attempt_totals (
  kind     text   NOT NULL,
  outcome  text   NOT NULL,
  bound    float8 NOT NULL,  -- the histogram bucket: the smallest bound >= duration; 'Infinity'
                             -- above the last; -1 when the attempt has no duration
  n        bigint NOT NULL,
  seconds  float8 NOT NULL,  -- sum of their durations
  PRIMARY KEY (kind, outcome, bound)
);

-- How far the totals have read job_attempts (by its id).
CREATE TABLE IF NOT EXISTS {schema}.attempt_totals_mark (
  singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
  last_id   bigint  NOT NULL
);
INSERT INTO {schema}.attempt_totals_mark (last_id) VALUES (0) ON CONFLICT DO NOTHING;
