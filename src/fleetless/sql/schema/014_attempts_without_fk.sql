-- The attempt history keeps its job's id without a foreign key: the key's check ran once per
-- history row (a lookup and a row lock on the job the same statement had just updated), a fifth
-- of a batch finish's time on the server. Every row is still written by the statement that writes
-- the job's outcome, for a job that exists; the statements that delete jobs (delete, prune_batch)
-- delete their history with them, as the cascade did. A job deleted by hand leaves its history.
ALTER TABLE {schema}.job_attempts DROP CONSTRAINT IF EXISTS job_attempts_job_id_fkey;
