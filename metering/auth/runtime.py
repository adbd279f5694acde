"""Auth's long-lived objects in the process's container (metering.container.Services), typed:
auth's functions take the container as an AuthServices, which it satisfies."""

from typing import Protocol

from metering.auth.failures import FailedCredentials
from metering.auth.invalidation import Credentials
from metering.auth.passwords import Passwords
from metering.auth.tokens import Signer
from metering.db import Database
from metering.settings import Settings


class AuthServices(Protocol):
    @property
    def settings(self) -> Settings: ...
    @property
    def db(self) -> Database: ...
    @property
    def passwords(self) -> Passwords: ...
    @property
    def signer(self) -> Signer: ...
    @property
    def credential_failures(self) -> FailedCredentials: ...
    @property
    def credentials(self) -> Credentials: ...
