"""Any OpenAI-compatible chat completions API."""

from metering.proxy.dialects.base import Dialect


class OpenAIDialect(Dialect):
    name = "openai"
