"""A 402 a person can act on: it names what the request needed to hold, and, when the client's
max_tokens was too large, the largest max_tokens that fits, which is then admitted."""

import json

from metering.money import format_usd
from metering.proxy.estimate import prompt_tokens_upper_bound
from tests.budgets.conftest import chat_body, marker

MINIMAX = "minimax-m2.1"  # 0.30 / 1.20 USD per 1M tokens
MINIMAX_IN, MINIMAX_OUT = 300_000, 1_200_000  # picodollars per token
LIMIT = 10**9  # 0.001 USD


def send(api, key: str, body: bytes):
    return api.request(
        "POST",
        "/v1/chat/completions",
        key=key,
        content=body,
        headers={"content-type": "application/json"},
    )


def prompt_hold(body: bytes) -> int:
    return prompt_tokens_upper_bound(len(body), json.loads(body)) * MINIMAX_IN


def test_a_402_names_the_hold_and_the_largest_max_tokens_that_fits(api):
    team, user, token = api.principal(token_limit=format_usd(LIMIT))
    body = chat_body(f"too big {marker()}", model=MINIMAX, max_tokens=1000)
    hold = prompt_hold(body) + 1000 * MINIMAX_OUT
    fits = (LIMIT - prompt_hold(body)) // MINIMAX_OUT
    assert 1 <= fits < 1000
    response = send(api, token["token"], body)
    assert response.status_code == 402, response.text
    assert response.headers["x-budget-scope"] == "token"
    assert "x-budget-resets-at" not in response.headers
    assert response.json()["error"]["message"] == (
        f"token budget {token['id']} cannot cover this request's hold of {format_usd(hold)} "
        "USD (its prompt and max_tokens 1000): limit 0.001 USD, spent 0, reserved 0, "
        f"remaining 0.001; never resets; max_tokens {fits} or less would fit"
    )
    # One more than it says is still refused (same body length: same prompt bound) ...
    tag = marker()
    over = send(
        api, token["token"], chat_body(f"too big {tag}", model=MINIMAX, max_tokens=fits + 1)
    )
    assert over.status_code == 402, over.text
    # ... and what it says is admitted.
    fitting = chat_body(f"too big {tag}", model=MINIMAX, max_tokens=fits)
    assert send(api, token["token"], fitting).status_code == 200


def test_a_402_says_no_max_tokens_fits_when_none_does(api):
    body = chat_body(f"prompt only {marker()}", model=MINIMAX, max_tokens=5)
    limit = prompt_hold(body) + MINIMAX_OUT - 1  # the prompt and not one output token
    team, user, token = api.principal(user_limit=format_usd(limit))
    response = send(api, token["token"], body)
    assert response.status_code == 402, response.text
    assert response.json()["error"]["message"] == (
        f"user budget {user['id']} cannot cover this request's hold of "
        f"{format_usd(prompt_hold(body) + 5 * MINIMAX_OUT)} USD (its prompt and max_tokens 5): "
        f"limit {format_usd(limit)} USD, spent 0, reserved 0, remaining {format_usd(limit)}; "
        "never resets"
    )


def test_a_402_without_max_tokens_names_its_smallest_hold(api):
    body = chat_body(f"prompt only {marker()}", model=MINIMAX)
    smallest = prompt_hold(body) + MINIMAX_OUT  # its prompt and one output token
    team, user, token = api.principal(team_limit=format_usd(smallest - 1))
    response = send(api, token["token"], body)
    assert response.status_code == 402, response.text
    assert response.headers["x-budget-scope"] == "team"
    assert response.json()["error"]["message"] == (
        f"team budget {team['id']} cannot cover this request's smallest hold of "
        f"{format_usd(smallest)} USD (its prompt and one output token): limit "
        f"{format_usd(smallest - 1)} USD, spent 0, reserved 0, remaining "
        f"{format_usd(smallest - 1)}; never resets"
    )
