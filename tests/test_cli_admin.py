"""`metering teams|users|tokens|webhooks ...` against a live server on both databases: each
command's output parsed (JSON, CSV, the table's rows), and its errors on stderr with exit 1."""

import http.server
import threading
import uuid

import pytest

from metering.cli import main
from metering.cli.webhooks import EVENT_TYPES
from metering.testing import free_port


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_a_team_is_created_listed_updated_and_deleted(api, cli):
    team_name = name("cli-team")
    made = cli.json(
        "teams", "create", "--name", team_name, "--credit-limit", "25.50",
        "--reset-interval", "monthly", "--alert-thresholds", "75,90", "--soft-limit", "20",
        "--rpm-limit", "60", "--tpm-limit", "100000", "--max-parallel-requests", "4",
        "--allowed-models", "gpt-*,minimax-m2.1", "--end-user-credit-limit", "0.50",
        "--end-user-reset-interval", "daily",
    )  # fmt: skip
    assert made == api.ok("GET", f"/v1/teams/{made['id']}")
    assert (made["end_user_credit_limit"], made["end_user_reset_interval"]) == ("0.5", "daily")
    assert (made["name"], made["credit_limit"], made["reset_interval"]) == (
        team_name, "25.5", "monthly"
    )  # fmt: skip
    assert (made["alert_thresholds"], made["soft_limit"]) == ([75, 90], "20")
    assert (made["rpm_limit"], made["tpm_limit"], made["max_parallel_requests"]) == (60, 100000, 4)
    assert made["allowed_models"] == ["gpt-*", "minimax-m2.1"]

    [row] = [r for r in cli.table("teams", "list") if r["id"] == made["id"]]
    assert (row["name"], row["credit_limit"], row["reset_interval"], row["rpm_limit"]) == (
        team_name, "25.5", "monthly", "60"
    )  # fmt: skip
    [line] = [r for r in cli.csv("teams", "list") if r["id"] == made["id"]]
    assert (line["name"], line["allowed_models"], line["soft_limit"]) == (
        team_name, "gpt-*,minimax-m2.1", "20"
    )  # fmt: skip
    listed = cli.json("teams", "list")
    assert made["id"] in {t["id"] for t in listed["data"]}

    changed = cli.json(
        "teams", "update", made["id"], "--credit-limit", "none", "--rpm-limit", "none",
        "--alert-thresholds", "default", "--allowed-models", "all", "--name", team_name + "-b",
        "--end-user-credit-limit", "none",
    )  # fmt: skip
    assert (changed["end_user_credit_limit"], changed["end_user_reset_interval"]) == (None, "daily")
    assert (changed["name"], changed["credit_limit"], changed["rpm_limit"]) == (
        team_name + "-b", None, None
    )  # fmt: skip
    assert (changed["alert_thresholds"], changed["allowed_models"]) == ([50, 80, 100], None)
    assert changed["tpm_limit"] == 100000  # what an update leaves out stays
    record = dict(line.split(None, 1) for line in cli("teams", "get", made["id"]).splitlines())
    assert (record["id"], record["name"], record["credit_limit"]) == (
        made["id"], team_name + "-b", "-"
    )  # fmt: skip

    assert cli("teams", "delete", made["id"]) == ""
    assert cli.err.strip() == f"deleted team {made['id']}"
    assert api.request("GET", f"/v1/teams/{made['id']}").status_code == 404


def test_a_user_is_created_listed_updated_and_deleted(api, cli, monkeypatch):
    team, other = api.team(), api.team()
    email = f"{name('ana')}@example.com"
    monkeypatch.setenv("ANA_PASSWORD", "correct horse battery")
    made = cli.json(
        "users", "create", "--email", email, "--name", "Ana", "--team", team["id"],
        "--credit-limit", "5", "--reset-interval", "7d", "--password-env", "ANA_PASSWORD",
    )  # fmt: skip
    assert (made["email"], made["name"], made["team_id"]) == (email, "Ana", team["id"])
    assert (made["credit_limit"], made["reset_interval"]) == ("5", "7d")
    login = api.request(
        "POST", "/v1/auth/login", json={"email": email, "password": "correct horse battery"}
    )
    assert login.status_code == 200  # the password from the variable is the user's

    [row] = cli.table("users", "list", "--team", team["id"])
    assert (row["id"], row["email"], row["team_id"], row["credit_limit"]) == (
        made["id"], email, team["id"], "5"
    )  # fmt: skip
    [line] = cli.csv("users", "list", "--team", team["id"])
    assert (line["id"], line["name"]) == (made["id"], "Ana")

    changed = cli.json("users", "update", made["id"], "--team", other["id"], "--name", "Ana B")
    assert (changed["team_id"], changed["name"], changed["credit_limit"]) == (
        other["id"], "Ana B", "5"
    )  # fmt: skip
    assert cli.json("users", "list", "--team", team["id"])["data"] == []
    budget = cli.json("users", "budget", made["id"])
    assert (budget["scope"], budget["credit_limit"], budget["spent"]) == ("user", "5", "0")

    cli("users", "delete", made["id"])
    assert cli.err.strip() == f"deleted user {made['id']}"
    assert api.request("GET", f"/v1/users/{made['id']}").status_code == 404


def test_a_token_is_created_with_its_secret_once_updated_listed_and_revoked(api, cli):
    team = api.team()
    user = api.user(team["id"])
    out = cli(
        "tokens", "create", "--user", user["id"], "--name", "notebook", "--credit-limit",
        "0.01", "--reset-interval", "daily", "--expires-in", "3600", "--allowed-models", "gpt-*",
    )  # fmt: skip
    record = dict(line.split(None, 1) for line in out.splitlines())
    secret = record["token"]
    assert secret.startswith("mtr_") and "shown this once" in cli.err
    assert (record["name"], record["credit_limit"], record["reset_interval"]) == (
        "notebook", "0.01", "daily"
    )  # fmt: skip
    assert record["expires_at"] != "-" and record["allowed_models"] == "gpt-*"
    me = api.ok("GET", "/v1/me", key=secret)
    assert (me["kind"], me["user_id"]) == ("api_token", user["id"])

    changed = cli.json("tokens", "update", record["id"], "--credit-limit", "0.02", "--expires-at",
                       "never", "--tpm-limit", "5000")  # fmt: skip
    assert (changed["credit_limit"], changed["expires_at"], changed["tpm_limit"]) == (
        "0.02", None, 5000
    )  # fmt: skip
    assert "token" not in changed  # the secret is never shown again

    [row] = cli.table("tokens", "list", "--user", user["id"])
    assert (row["id"], row["name"], row["prefix"], row["revoked_at"]) == (
        record["id"], "notebook", secret[:12], "-"
    )  # fmt: skip
    [line] = cli.csv("tokens", "list", "--user", user["id"])
    assert (line["id"], line["credit_limit"], line["tpm_limit"]) == (record["id"], "0.02", "5000")

    cli("tokens", "delete", record["id"])
    assert cli.err.strip() == f"revoked token {record['id']}"
    assert api.request("GET", "/v1/me", key=secret).status_code == 401
    assert cli.json("tokens", "list", "--user", user["id"])["data"] == []
    [revoked] = cli.json("tokens", "list", "--user", user["id"], "--include-revoked")["data"]
    assert revoked["id"] == record["id"] and revoked["revoked_at"] is not None


def test_listing_pages_through_the_api_up_to_the_limit(api, cli):
    team = api.team()
    users = {api.user(team["id"])["id"] for _ in range(3)}
    listed = cli.json("users", "list", "--team", team["id"], "--limit", "2")["data"]
    assert len(listed) == 2 and set(u["id"] for u in listed) < users
    rest = cli.json("users", "list", "--team", team["id"], "--after", listed[-1]["id"])["data"]
    assert {u["id"] for u in listed + rest} == users


def test_search_lists_only_the_matching_teams_users_and_tokens(api, cli):
    word = uuid.uuid4().hex[:10]
    team = api.ok("POST", "/v1/teams", 201, json={"name": f"Search {word}"})
    api.team()  # another team: not found
    [found] = cli.json("teams", "list", "--search", word.upper())["data"]
    assert found["id"] == team["id"]
    user = api.user(team["id"])
    api.user(team["id"])
    [found] = cli.json("users", "list", "--search", user["email"])["data"]
    assert found["id"] == user["id"]
    token = api.token(user["id"])
    api.token(user["id"])
    listed = cli.json("tokens", "list", "--user", user["id"], "--search", token["prefix"])
    assert [t["id"] for t in listed["data"]] == [token["id"]]


def test_a_webhook_is_created_tested_listed_and_deleted(api, cli, monkeypatch):
    # .invalid never resolves: the server's deliveries fail, the API's answers are what is tested
    target = f"https://{name('hooks')}.example.invalid/metering"
    monkeypatch.setenv("HOOK_SECRET", "s" * 32)
    made = cli.json(
        "webhooks", "create", target, "--event", "budget.exhausted", "--event", "token.expiring",
        "--secret-env", "HOOK_SECRET",
    )  # fmt: skip
    assert (made["url"], made["events"], made["team_id"], made["secret"]) == (
        target, ["budget.exhausted", "token.expiring"], None, "s" * 32
    )  # fmt: skip
    [row] = [r for r in cli.table("webhooks", "list") if r["id"] == made["id"]]
    assert (row["url"], row["events"], row["team_id"]) == (
        target, "budget.exhausted,token.expiring", "-"
    )  # fmt: skip
    sent = cli.json("webhooks", "test", made["id"])
    [delivery] = cli.json("webhooks", "deliveries", made["id"])["data"]
    assert (delivery["id"], delivery["event_id"], delivery["event_type"]) == (
        sent["delivery_id"], sent["event_id"], "webhook.test"
    )  # fmt: skip
    [line] = cli.csv("webhooks", "deliveries", made["id"])
    assert (line["id"], line["event_type"]) == (sent["delivery_id"], "webhook.test")
    cli("webhooks", "delete", made["id"])
    assert cli.err.strip() == f"deleted webhook {made['id']}"
    assert made["id"] not in {w["id"] for w in api.ok("GET", "/v1/webhooks")["data"]}


def test_the_webhook_event_types_are_the_servers():
    from metering.alerts.record import TYPES

    assert EVENT_TYPES == TYPES


def test_a_field_the_api_refuses_is_its_message_and_exit_1(api, cli):
    err = cli.error("teams", "create", "--name", name("bad"), "--credit-limit", "0.5x")
    assert err.startswith("metering: 400 invalid_request: ") and "credit_limit" in err
    assert err.count("\n") == 1
    err = cli.error("teams", "create", "--name", name("bad"), "--reset-interval", "fortnightly")
    assert err.startswith("metering: 400 invalid_request: ") and "reset_interval" in err


def test_an_unknown_id_is_a_404_and_exit_1(cli):
    assert (
        cli.error("teams", "get", "team_nope")
        == "metering: 404 not_found: team team_nope not found\n"
    )
    assert cli.error("tokens", "delete", "tok_nope").startswith("metering: 404 not_found: ")
    assert cli.error("users", "update", "user_nope", "--name", "x").startswith(
        "metering: 404 not_found: "
    )


def test_a_taken_name_is_the_apis_409(api, cli):
    team = api.team()
    err = cli.error("teams", "create", "--name", team["name"].upper())
    assert err.startswith("metering: 409 team_name_taken: ") and team["id"] in err


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_wrong_key_is_the_apis_401(cli, monkeypatch):
    monkeypatch.setenv("OTHER_KEY", "not-the-admin-key")
    err = cli.error("teams", "list", "--key-env", "OTHER_KEY")
    assert err.startswith("metering: 401 invalid_api_key: ")


def test_an_update_without_a_field_changes_nothing_and_says_so(capsys):
    assert main(["teams", "update", "team_x", "--url", "http://127.0.0.1:1"]) == 2
    assert "nothing to change" in capsys.readouterr().err


def test_without_a_key_it_says_which_variable_to_set(capsys, monkeypatch):
    monkeypatch.delenv("METERING_ADMIN_KEY", raising=False)
    assert main(["teams", "list", "--url", "http://127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == (
        "metering: set METERING_ADMIN_KEY to the admin key (or name the variable that holds a "
        "key with --key-env NAME)\n"
    )


def test_a_server_that_is_down_is_a_clear_message_and_exit_1(capsys, monkeypatch):
    monkeypatch.setenv("METERING_ADMIN_KEY", "any")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["--url", url, "teams", "list"]) == 1
    assert capsys.readouterr().err == (
        f"metering: cannot connect to {url} (connection refused): is the server running there? "
        "--url or METERING_URL says where it is\n"
    )


def test_a_number_option_that_is_not_one_is_refused_before_any_request(capsys):
    with pytest.raises(SystemExit) as done:
        main(["teams", "create", "--name", "x", "--rpm-limit", "sixty"])
    assert done.value.code == 2
    assert "--rpm-limit: invalid whole value: 'sixty'" in capsys.readouterr().err


@pytest.mark.e2e  # serves a page on loopback
def test_another_server_at_the_address_is_named_not_a_traceback(capsys, monkeypatch):
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the stdlib's name
            body = b"<html>not metering</html>"
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("METERING_ADMIN_KEY", "any")
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert main(["teams", "list", "--url", url]) == 1
    finally:
        server.shutdown()
    assert capsys.readouterr().err == (
        f"metering: {url}/v1/teams?limit=1000 answered 200 without JSON: is a metering server at "
        "that address?\n"
    )


def test_a_limit_below_one_is_refused(capsys):
    with pytest.raises(SystemExit) as done:
        main(["usage", "--limit", "0"])
    assert done.value.code == 2
    assert "--limit: invalid positive value: '0'" in capsys.readouterr().err


def test_an_end_users_budget_is_set_read_listed_and_cleared(api, cli):
    team = api.team()
    cli("teams", "update", team["id"], "--end-user-credit-limit", "1", "--format", "json")
    own = cli.json("end-users", "set", "--team", team["id"], "cust/42", "--credit-limit", "0.25",
                   "--reset-interval", "daily")  # fmt: skip
    assert (own["end_user"], own["override"], own["credit_limit"], own["reset_interval"]) == (
        "cust/42", True, "0.25", "daily"
    )  # fmt: skip
    assert cli.json("end-users", "get", "--team", team["id"], "cust/42") == own
    [row] = cli.table("end-users", "list", "--team", team["id"])
    assert (row["end_user"], row["override"], row["credit_limit"], row["spent"]) == (
        "cust/42", "true", "0.25", "0"
    )  # fmt: skip
    cli("end-users", "clear", "--team", team["id"], "cust/42")
    assert "back on the team's default budget" in cli.err
    default = cli.json("end-users", "get", "--team", team["id"], "cust/42")
    assert (default["override"], default["credit_limit"]) == (False, "1")
