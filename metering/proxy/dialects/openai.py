"""Any OpenAI-compatible chat completions API: the client's request as sent, with the
upstream's model name, the output limit the hold was sized for and usage asked for in streams.
OpenAI's reference takes `user` and `safety_identifier` (the end user): both are sent up;
`metadata` is the request's tags here, and is not."""

from metering.proxy.dialects.base import IDENTIFIERS, Dialect


class OpenAIDialect(Dialect):
    name = "openai"
    reasoning_effort = True
    max_tokens_key = None  # OpenAI takes both, and its reasoning models only the newer one
    identifiers = IDENTIFIERS
