-- The role Grafana queries with: SELECT on what the dashboards show and nothing else. It cannot
-- write, and cannot read password or token hashes, sessions or the token-signing secret
-- (key_values). Run as the database's owner once the schema exists (after `metering db
-- upgrade`; docker-compose's grafana-reader service runs it once the service is healthy), with
-- the role's name and password in the environment:
--   GRAFANA_DB_USER=grafana_reader GRAFANA_DB_PASSWORD=... psql -f grafana-reader.sql
-- Safe to run again (a changed password is applied; tables added later need a new GRANT).
\set ON_ERROR_STOP on
\getenv reader GRAFANA_DB_USER
\getenv reader_password GRAFANA_DB_PASSWORD

SELECT format('CREATE ROLE %I', :'reader')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'reader') \gexec
ALTER ROLE :"reader" WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'reader_password';

GRANT USAGE ON SCHEMA public TO :"reader";
GRANT SELECT ON teams, budgets, budget_windows, spend_hourly, spend_hourly_token,
    spend_hourly_model, spend_daily, spend_daily_token, spend_daily_model, ledger_events,
    ledger_events_archive, spend_hourly_model_live, spend_hourly_token_live, spend_daily_end_user
    TO :"reader";
-- The increments not yet folded into spend_daily_end_user (the top end users panel adds them).
GRANT SELECT (hour, team_id, end_user, cost) ON rollup_pending TO :"reader";
GRANT SELECT (id, subject_id, amount) ON budget_leases TO :"reader";
GRANT SELECT (amount, token_lease, user_lease, team_lease) ON holds TO :"reader";
GRANT SELECT (id, email, name, team_id, created_at, deleted_at) ON users TO :"reader";
GRANT SELECT (id, user_id, name, prefix, expires_at, created_at, revoked_at) ON api_tokens
    TO :"reader";
