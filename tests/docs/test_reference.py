"""docs/operator/configuration.md is what scripts/reference.py writes from the settings class:
every setting, its variable, type, bounds, default and meaning. It cannot drift."""

import pytest
from pydantic.fields import FieldInfo

from metering.settings import Settings
from scripts import reference


def test_the_committed_page_is_what_the_settings_class_says():
    assert reference.CONFIGURATION.read_text() == reference.configuration(), (
        "docs/operator/configuration.md is stale: run `make reference`"
    )
    assert reference.stale() == []
    assert reference.main(["--check"]) == 0


def test_every_setting_has_its_section_and_row():
    page = reference.CONFIGURATION.read_text()
    for name in Settings.model_fields:
        variable = f"METERING_{name.upper()}"
        assert f"\n## `{variable}`\n" in page
        assert f"| [`{variable}`](#{variable.lower()}) |" in page
    assert page.count("\n## `METERING_") == len(Settings.model_fields) >= 40


@pytest.mark.parametrize(
    ("name", "row"),
    [
        ("lease_share", "integer, >= 0, <= 1000 | `8` |"),
        ("token_max_lifetime_s", "integer, >= 1, or unset | unset |"),
        ("openapi_enabled", "boolean | `true` |"),
        ("max_response_s", "number, > 0 | `3600` |"),
        ("focus_billing_account", "text, 1 to 200 characters | `metering` |"),
    ],
)
def test_a_row_gives_the_type_bounds_and_default(name, row):
    field = Settings.model_fields[name]
    assert f"{reference.kind(field)} | {reference.default(field)} |" == row


def test_a_setting_without_a_meaning_is_refused():
    with pytest.raises(SystemExit, match="new_setting has no docstring"):
        reference.meaning(FieldInfo(annotation=int, default=1), "new_setting")


def test_check_reports_a_stale_page(tmp_path, monkeypatch, capsys):
    page = tmp_path / "configuration.md"
    page.write_text("# Configuration\n")
    monkeypatch.setattr(reference, "ROOT", tmp_path)
    monkeypatch.setattr(reference, "PAGES", {page: reference.configuration})
    assert reference.main(["--check"]) == 1
    assert "configuration.md is stale" in capsys.readouterr().err
    assert reference.main([]) == 0
    assert page.read_text() == reference.configuration()
