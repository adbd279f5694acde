"""One module per upstream dialect; `dialect_for(name)` picks one."""

from metering.proxy.dialects.base import Dialect
from metering.proxy.dialects.exascale import ExascaleDialect
from metering.proxy.dialects.openai import OpenAIDialect

_DIALECTS: dict[str, Dialect] = {
    "openai": OpenAIDialect(),
    "exascale": ExascaleDialect(),
}


def dialect_for(name: str) -> Dialect:
    try:
        return _DIALECTS[name]
    except KeyError:
        raise ValueError(f"dialect {name!r} is not available") from None
