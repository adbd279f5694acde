"""The price history: a catalog entry's effective_from (RFC 3339) and which row holds when."""

from datetime import UTC, datetime, timedelta

import pytest

from metering.ledger.prices import PriceBook, PriceRow
from metering.settings import CatalogError, parse_catalog

PROVIDERS = {"p": {"base_url": "http://127.0.0.1:9/v1", "dialect": "openai"}}


def entry(**fields) -> dict:
    return {
        "name": "m",
        "provider": "p",
        "input_usd_per_mtok": "1",
        "output_usd_per_mtok": "2",
        **fields,
    }


def test_effective_from_is_rfc3339_with_its_zone():
    catalog = parse_catalog(
        {"providers": PROVIDERS, "models": [entry(effective_from="2026-11-01T00:00:00+01:00")]}
    )
    (route,) = catalog.routes("m")
    assert route.effective_from == datetime(2026, 10, 31, 23, tzinfo=UTC)
    (plain,) = parse_catalog({"providers": PROVIDERS, "models": [entry()]}).routes("m")
    assert plain.effective_from is None and plain.input_micro == route.input_micro
    for bad in ("yesterday", "2026-11-01T00:00:00", 20261101, "x" * 100):
        with pytest.raises(CatalogError, match="effective_from"):
            parse_catalog({"providers": PROVIDERS, "models": [entry(effective_from=bad)]})


def test_the_row_recorded_last_among_those_in_effect_holds():
    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    book = PriceBook(
        {
            ("m", "p"): [
                PriceRow(1, t0 + timedelta(days=5), "u", (10, 10, 10)),  # recorded first
                PriceRow(2, t0, "u", (1, 1, 1)),  # a correction from before it
                PriceRow(3, t0 + timedelta(days=9), "u", (7, 7, 7)),  # a later change
            ]
        }
    )
    assert book.at("m", "p", t0 - timedelta(seconds=1)) is None
    assert book.at("m", "p", t0).prices == (1, 1, 1)
    assert book.at("m", "p", t0 + timedelta(days=6)).prices == (1, 1, 1)
    assert book.at("m", "p", t0 + timedelta(days=9)).prices == (7, 7, 7)
    assert book.at("m", "other", t0) is None
