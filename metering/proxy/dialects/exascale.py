"""Exascale (shared/seeds/exascale-chat-completions.txt).

OpenAI-compatible, plus `developer` role, `reasoning_content`, `reasoning_details`,
`name` and `sla_metrics`, all passed through untouched. Its streams always end
with a usage chunk, asked for or not; the proxy withholds it from clients that
did not ask for include_usage.
"""

from metering.proxy.dialects.base import Dialect


class ExascaleDialect(Dialect):
    name = "exascale"
    include_usage = True
    usage_always_in_stream = True
