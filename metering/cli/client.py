"""The admin client's one way to the server: the HTTP API, with a bearer key, its errors made
`metering: <status> <code>: <message>`. httpx is loaded when a request is made, not before."""

import argparse
from typing import TYPE_CHECKING, Any

from metering.cli.options import CliError, bearer_key, server_url

if TYPE_CHECKING:
    import httpx

TIMEOUT_S = 30.0


class Api:
    """One server, one key. Every answer but a 2xx is a CliError carrying the API's own error."""

    def __init__(self, url: str, key: str, timeout_s: float = TIMEOUT_S) -> None:
        import httpx

        from metering import __version__

        self.url = url
        self.http = httpx.Client(
            base_url=url,
            timeout=timeout_s,
            headers={"authorization": f"Bearer {key}", "user-agent": f"metering-cli/{__version__}"},
        )

    @classmethod
    def of(cls, args: argparse.Namespace) -> "Api":
        return cls(server_url(args), bearer_key(args))

    def __enter__(self) -> "Api":
        return self

    def __exit__(self, *_: object) -> None:
        self.http.close()

    def send(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | list[tuple[str, Any]] | None = None,
        body: dict[str, Any] | None = None,
    ) -> "httpx.Response":
        import httpx

        try:
            response = self.http.request(method, path, params=params, json=body)
        except httpx.ConnectError as exc:
            raise CliError(
                f"cannot connect to {self.url} ({reason(exc)}): is the server running there? "
                "--url or METERING_URL says where it is"
            ) from None
        except httpx.TimeoutException:
            raise CliError(f"{self.url} did not answer within {TIMEOUT_S:.0f} s") from None
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            raise CliError(f"cannot reach {self.url}: {exc}") from None
        if response.is_error:
            raise CliError(api_error(response))
        return response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return decoded(self.send(method, path, **kwargs))

    def pages(
        self, path: str, limit: int, params: dict[str, Any] | None = None, key: str = "id"
    ) -> list[dict]:
        """Up to `limit` objects of a list that pages by `after` (the `key` of the last seen)."""
        out: list[dict] = []
        after = None
        while len(out) < limit:
            size = min(1000, limit - len(out))
            query = {**(params or {}), "limit": size, **({"after": after} if after else {})}
            page = self.json("GET", path, params=query)["data"]
            out.extend(page)
            if len(page) < size:
                break
            after = page[-1][key]
        return out


def decoded(response: "httpx.Response") -> Any:
    """The answer's JSON; an answer that is not (another server at that address) says so."""
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        raise CliError(
            f"{response.url} answered {response.status_code} without JSON: is a metering server "
            "at that address?"
        ) from None


def reason(exc: Exception) -> str:
    text = str(exc).lower()
    return "connection refused" if "refused" in text else str(exc) or type(exc).__name__


def api_error(response: "httpx.Response") -> str:
    """`<status> <code>: <message>` from the API's OpenAI-shaped error body (or what came)."""
    try:
        error = response.json()["error"]
        code, message = error.get("code") or error.get("type"), error["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        text = " ".join(response.text.split())[:300]
        return f"{response.status_code} {response.reason_phrase}: {text or '(no body)'}"
    return f"{response.status_code} {code}: {message}"
