-- A handler module's handle(payload) returns a JSON value: it is stored as jsonb beside the text
-- result (a script's stdout, which stays text). Nullable and additive, so old rows keep their text
-- result as it was and old drainers keep working.
ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS result_json jsonb;
