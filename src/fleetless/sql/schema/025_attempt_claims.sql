-- The attempt history names the claim each row ends: its claim token, written by the finish that
-- wrote the outcome, in the same statement. A finish retried after its reply was lost finds its
-- own earlier write by it (outcomes_of), also once the job has been claimed again under another
-- token (a snooze or a retry due at once, taken by the next claim before the retry): the job's
-- own row no longer carries the old token, the history row does. NULL on a reaped attempt's row
-- (its claim wrote nothing) and on rows written before this migration. Nullable, no default: no
-- rewrite of a large history.
ALTER TABLE {schema}.job_attempts ADD COLUMN IF NOT EXISTS claim_token uuid;
