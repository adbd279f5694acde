"""metering: an OpenAI-compatible proxy that meters LLM usage into an exact ledger."""

# The one place the version is written: the package metadata reads it (pyproject.toml,
# [tool.setuptools.dynamic]), `metering --version` prints it, /healthz and /openapi.json show it.
# CHANGELOG.md has a section for each version.
__version__ = "0.6.0"
