"""A client generated from /openapi.json works: OpenAPI Generator's Python client (the jar in
the openapi-generator-cli wheel, run on the machine's Java, offline) is generated from the live
server's document, imported, and runs the operator walkthrough against that server: a team, a
user and a token made through it, a budget that refuses the openai SDK with a 402, the limit
raised through it, the usage and spend read back through it (its models check every answer
against the document's schemas), the token revoked, and an error answered in the document's
shape."""

import importlib
import json
import subprocess
import sys
import uuid
from decimal import Decimal

import openai
import pytest

from tests.conftest import ADMIN_KEY

PACKAGE = "metering_client"


@pytest.fixture(scope="module")
def generated(api, tmp_path_factory):
    """The client package generated from the server's own document, imported."""
    out = tmp_path_factory.mktemp("client")
    document = out / "openapi.json"
    document.write_text(json.dumps(api.ok("GET", "/openapi.json")))
    subprocess.run(
        [
            str(sys.executable.rsplit("/", 1)[0] + "/openapi-generator-cli"),
            "generate",
            "-i",
            str(document),
            "-g",
            "python",
            "-o",
            str(out / "client"),
            "--package-name",
            PACKAGE,
            "--global-property",
            "apiTests=false,modelTests=false,apiDocs=false,modelDocs=false",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    sys.path.insert(0, str(out / "client"))
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]  # the other database's server generated the same package
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(out / "client"))


def test_the_operator_walkthrough_through_a_generated_client(api, generated):
    mc = generated
    tag = uuid.uuid4().hex[:8]
    with mc.ApiClient(mc.Configuration(host=api.url, access_token=ADMIN_KEY)) as client:
        admin = mc.DefaultApi(client)
        team = admin.create_team_v1_teams_post(mc.TeamCreate(name=f"gen-{tag}", credit_limit="5"))
        user = admin.create_user_v1_users_post(
            mc.UserCreate(team_id=team.id, email=f"gen-{tag}@example.com", name="Gen")
        )
        token = admin.create_token_v1_users_user_id_tokens_post(
            user.id, mc.TokenCreate(name="notebook", credit_limit="0.000000000001")
        )
        assert token.token.startswith("mtr_") and token.user_id == user.id

        sdk = api.openai(token.token)
        messages = [{"role": "user", "content": "walkthrough"}]
        with pytest.raises(openai.APIStatusError) as refused:
            sdk.chat.completions.create(model="gpt-sim", messages=messages)
        assert refused.value.status_code == 402
        assert refused.value.response.headers["x-budget-scope"] == "token"

        raised = admin.patch_token_v1_tokens_token_id_patch(
            token.id, mc.TokenPatch(credit_limit="1")
        )
        assert raised.credit_limit == "1"
        answers = [sdk.chat.completions.create(model="gpt-sim", messages=messages) for _ in "ab"]

        usage = admin.list_usage_v1_usage_get(token_id=token.id)
        assert sorted(e.id for e in usage.data) == sorted(a._request_id for a in answers)
        spend = admin.spend_v1_spend_get(token_id=token.id, group_by="model")
        assert Decimal(spend.total.cost) == sum(Decimal(e.cost) for e in usage.data) > 0
        budget = admin.token_budget_v1_tokens_token_id_budget_get(token.id)
        assert Decimal(budget.spent) == Decimal(spend.total.cost)

        admin.revoke_token_v1_tokens_token_id_delete(token.id)
        with pytest.raises(openai.AuthenticationError):
            sdk.chat.completions.create(model="gpt-sim", messages=messages)

        with pytest.raises(mc.ApiException) as missing:
            admin.get_team_v1_teams_team_id_get("team_" + "0" * 32)
        assert missing.value.status == 404
        assert json.loads(missing.value.body)["error"]["code"] == "not_found"
