"""A credential's limits beyond credit, as its token, user and team set them: requests and
tokens per minute, requests in flight, model allow-lists. Plain values, carried by the cached
principal (metering.auth) and counted by metering.budgets.rates."""

import fnmatch
import json
from dataclasses import dataclass, field

SCOPES = ("token", "user", "team")
KINDS = ("rpm", "tpm", "parallel")
# The bounds on what may be set.
MAX_RPM = 1_000_000_000
MAX_TPM = 1_000_000_000_000
MAX_PARALLEL = 1_000_000
MAX_MODELS = 100
PATTERN_CHARS = 200


def allows(patterns: tuple[str, ...] | None, model: str) -> bool:
    """`None` allows every model; otherwise a name matches one of the patterns (`*`, `?`)."""
    return patterns is None or any(fnmatch.fnmatchcase(model, p) for p in patterns)


def parse_models(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(json.loads(text))


def dump_models(patterns: list[str] | tuple[str, ...] | None) -> str | None:
    return None if patterns is None else json.dumps(list(patterns))


@dataclass(frozen=True, slots=True)
class ScopeLimits:
    """One subject's limits beyond credit (None: no such limit)."""

    scope: str
    subject_id: str
    rpm: int | None = None
    tpm: int | None = None
    parallel: int | None = None
    models: tuple[str, ...] | None = None

    def cap(self, kind: str) -> int | None:
        return {"rpm": self.rpm, "tpm": self.tpm, "parallel": self.parallel}[kind]

    @property
    def empty(self) -> bool:
        return (
            self.rpm is None and self.tpm is None and self.parallel is None and self.models is None
        )


@dataclass(frozen=True, slots=True)
class Limits:
    """A credential's limits at every scope that has some (token, user, team order)."""

    scopes: tuple[ScopeLimits, ...]
    rated: bool = field(init=False)

    def __post_init__(self) -> None:
        rated = any(s.cap(k) is not None for s in self.scopes for k in KINDS)
        object.__setattr__(self, "rated", rated)

    @classmethod
    def of(cls, *scopes: ScopeLimits) -> "Limits | None":
        kept = tuple(s for s in scopes if not s.empty)
        return cls(kept) if kept else None

    def refusing(self, model: str) -> ScopeLimits | None:
        """The first scope whose allow-list leaves `model` out, if any."""
        for scope in self.scopes:
            if not allows(scope.models, model):
                return scope
        return None

    def tightest_tpm(self) -> int | None:
        caps = [s.tpm for s in self.scopes if s.tpm is not None]
        return min(caps, default=None)


def scope_limits(scope: str, subject_id: str, rpm, tpm, parallel, models) -> ScopeLimits:
    """From a subject row's columns."""
    return ScopeLimits(scope, subject_id, rpm, tpm, parallel, parse_models(models))
