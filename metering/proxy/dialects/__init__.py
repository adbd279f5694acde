"""One module per upstream dialect; `dialect_for(name)` picks one."""

from metering.proxy.dialects.base import Dialect
from metering.proxy.dialects.exascale import ExascaleDialect
from metering.proxy.dialects.genesis import GenesisDialect
from metering.proxy.dialects.nim import NimDialect
from metering.proxy.dialects.openai import OpenAIDialect
from metering.proxy.dialects.tokenchange import TokenChangeDialect

__all__ = ["Dialect", "dialect_for"]

_DIALECTS: dict[str, Dialect] = {
    d.name: d
    for d in (
        OpenAIDialect(),
        ExascaleDialect(),
        GenesisDialect(),
        TokenChangeDialect(),
        NimDialect(),
    )
}


def dialect_for(name: str) -> Dialect:
    try:
        return _DIALECTS[name]
    except KeyError:
        raise ValueError(f"dialect {name!r} is not available") from None
