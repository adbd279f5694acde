"""MkDocs hook: writes the API's OpenAPI document to docs/api/openapi.json before the pages are
read, from the application the service runs (metering.app.create_app), so the API reference
(docs/api/reference.md, rendered by the OAD plugin) is the code's, never a copy. Nothing starts:
no database, no server; the document is built from the routes alone."""

import json
from pathlib import Path

from metering.app import create_app
from metering.settings import Catalog, Settings

TARGET = Path(__file__).resolve().parents[1] / "api" / "openapi.json"


def on_pre_build(config) -> None:
    # No environment, no .env file: the document is the same on every machine.
    settings = Settings(_env_file=None, openapi_enabled=True)
    document = create_app(settings, catalog=Catalog(), run_jobs=False).openapi()
    text = json.dumps(document, indent=2, sort_keys=False) + "\n"
    # Written only when it changed: `mkdocs serve` rebuilds on every write under docs/.
    if not TARGET.exists() or TARGET.read_text() != text:
        TARGET.parent.mkdir(parents=True, exist_ok=True)
        TARGET.write_text(text)
