-- Watch mode: one watcher per set of queues, a row here instead of a session advisory lock (any
-- role that can connect could hold that key and make every cron tick exit, issue 25 item 7; a
-- stopped watcher's session kept it forever, issue 26 item 6). The watcher renews heartbeat_at
-- every few seconds; a cron tick takes the row over once the heartbeat is older than the lease
-- the holder declared (drain --watch-lease), so a stopped or hung watcher stalls its queues for
-- at most that long.
CREATE TABLE IF NOT EXISTS {schema}.watchers (
  queues        text        PRIMARY KEY,  -- the set: its queue names sorted and comma-joined, or '*'
  holder        text        NOT NULL,     -- host:pid:random of the watcher holding it
  heartbeat_at  timestamptz NOT NULL,
  lease_seconds float8      NOT NULL
);
