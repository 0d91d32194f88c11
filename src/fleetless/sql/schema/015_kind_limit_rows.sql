-- One row per kind with a global limit (concurrency or rate). A limited claim locks its kind's row
-- (FOR UPDATE, under a bounded lock_timeout) so that claims of the kind by all drainers on all
-- hosts take turns. A row lock of fleetless's own table, not an advisory lock: only roles with
-- rights on this table can take it, where any role that can connect could hold an advisory key
-- and stall every claim of the kind (issue 25 item 7). The claim inserts the row it needs.
CREATE TABLE IF NOT EXISTS {schema}.kind_limits (
  kind text PRIMARY KEY
);
