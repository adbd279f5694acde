"""metering.example.toml: it parses, it lists the four seed providers with their dialects, and
its MiniMax-M2.5 partners carry exactly the serverless prices of the NVIDIA NIM catalog seed
(../shared/seeds/nvidia-nim-minimax-m2.5-catalog.txt)."""

import json
from decimal import Decimal
from pathlib import Path

import pytest

from metering.money import MICRO
from metering.proxy.routing import Target, candidates
from metering.settings import load_catalog

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "metering.example.toml"
SEEDS = ROOT.parent / "shared" / "seeds"
NIM_SEED = SEEDS / "nvidia-nim-minimax-m2.5-catalog.txt"
# The seed's partnerDisplayName -> the example catalog's provider name.
PARTNERS = {
    "Baseten": "baseten",
    "Bitdeer AI": "bitdeer",
    "CoreWeave": "coreweave",
    "Deep Infra": "deepinfra",
    "Digital Ocean": "digitalocean",
    "Fireworks AI": "fireworks",
    "GMI Cloud": "gmicloud",
    "Lightning AI": "lightning",
    "Together AI": "together",
    "Vultr": "vultr",
}


def seed_partner_prices() -> dict[str, tuple[Decimal, Decimal]]:
    """partnerDisplayName -> (USD_INPUT, USD_OUTPUT) per 1M tokens of its serverless offer.

    The seed is a page's serialized state, not JSON as a whole: the partner list is the JSON
    array after the first `"data":`, under the query key `endpoint-partners`."""
    text = NIM_SEED.read_text()
    start = text.index('"data":', text.index('"queries"')) + len('"data":')
    partners, end = json.JSONDecoder().raw_decode(text, start)
    assert '"queryKey":["endpoint-partners","minimax-m2.5"' in text[end : end + 2000]
    prices = {}
    for partner in partners:
        serverless = [c for c in partner["compute"] if c["type"] == "serverless"]
        assert len(serverless) == 1, partner["partnerDisplayName"]
        price = serverless[0]["priceDimensions"]
        assert price["unit"] == "1M Tokens"
        per_unit = price["pricePerUnit"]
        prices[partner["partnerDisplayName"]] = (
            Decimal(per_unit["USD_INPUT"]),
            Decimal(per_unit["USD_OUTPUT"]),
        )
    return prices


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(EXAMPLE, environ={})


@pytest.fixture(scope="module")
def seed_prices():
    if not NIM_SEED.exists():
        pytest.skip(f"the provider seeds are not here: {SEEDS} (a checkout without ../shared)")
    return seed_partner_prices()


def test_the_seed_parses_to_the_partners_we_know(seed_prices):
    assert set(seed_prices) == set(PARTNERS)
    assert seed_prices["Deep Infra"] == (Decimal("0.27"), Decimal("0.95"))
    assert seed_prices["Lightning AI"] == (Decimal("0.25"), Decimal("1.20"))
    others = set(PARTNERS) - {"Deep Infra", "Lightning AI"}
    assert {seed_prices[name] for name in others} == {(Decimal("0.30"), Decimal("1.20"))}


def test_the_example_lists_the_four_seed_providers_with_their_dialects(catalog):
    dialects = {name: provider.dialect for name, provider in catalog.providers.items()}
    assert {
        "exascale": "exascale",
        "genesis": "genesis",
        "tokenchange": "tokenchange",
        "nvidia": "nim",
    }.items() <= dialects.items()
    nvidia = catalog.providers["nvidia"]
    assert nvidia.status_url and "{request_id}" in nvidia.status_url
    assert nvidia.poll_timeout_s > 0 and nvidia.poll_interval_s > 0
    assert catalog.providers["exascale"].base_url == "https://gpu-api.exascalelabs.ai/api/v1"
    assert catalog.providers["genesis"].base_url == "https://token.moi.matrixorigin.cn/v1"
    assert catalog.providers["tokenchange"].base_url == "https://inference.tokenchange.io/v1"
    assert catalog.providers["nvidia"].base_url == "https://integrate.api.nvidia.com/v1"
    # Every model's provider is a configured one (load_catalog checks) and every provider is used.
    used = {route.provider for routes in catalog.models.values() for route in routes}
    assert used == set(catalog.providers)


def test_minimax_m25_partners_are_priced_as_the_nim_catalog_says(catalog, seed_prices):
    routes = {route.provider: route for route in catalog.routes("minimax-m2.5")}
    assert set(routes) == {PARTNERS[name] for name in seed_prices}
    for name, (price_in, price_out) in seed_prices.items():
        route = routes[PARTNERS[name]]
        assert (route.input_micro / MICRO, route.output_micro / MICRO) == (
            price_in,
            price_out,
        ), name
        # No cached price is published: cached input is charged as input.
        assert route.cached_micro == route.input_micro
        assert route.max_output_tokens == 16384


def test_the_example_routes_minimax_m25_by_expected_cost(catalog):
    target = Target("minimax-m2.5", None, None)
    # A short prompt with the default expected output: Deep Infra's output price wins.
    order = candidates(catalog, target, {}, 50, None)
    assert order[0].provider == "deepinfra" and order[1].provider == "lightning"
    # A long prompt and one output token: Lightning AI's input price wins.
    order = candidates(catalog, target, {}, 100_000, 1)
    assert order[0].provider == "lightning" and order[1].provider == "deepinfra"
    # A cap on the output price leaves Deep Infra alone.
    capped = candidates(catalog, target, {"max_output_usd_per_mtok": "1.00"}, 50, None)
    assert [r.provider for r in capped] == ["deepinfra"]
