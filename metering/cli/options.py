"""What every command of `metering` shares: its help layout (each option's default shown), its
one error, and the options that say where the server is and which variable holds the key."""

import argparse
import os
from collections.abc import Callable
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8080"
URL_ENV = "METERING_URL"
KEY_ENV = "METERING_ADMIN_KEY"
FORMATS = ("table", "csv", "json")


class CliError(Exception):
    """A command that cannot do what it was asked: `metering: <message>` on stderr, exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message, self.code = message, code


class HelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default (or says it is required), unless the help says
    it already (an option whose absence means something other than a value: "default:
    unchanged", "default: all")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.required and action.option_strings and "required" not in text:
            return f"{text} (required)"
        if "default" in text or not action.option_strings:
            return text
        if action.default in (None, argparse.SUPPRESS) or isinstance(action.default, bool):
            return text
        return f"{text} (default: {action.default})"


def subparsers(parser: argparse.ArgumentParser, dest: str) -> Any:
    """A group of subcommands whose parsers share the help layout."""
    return parser.add_subparsers(dest=dest, required=True, metavar="COMMAND")


def command(group: Any, name: str, help: str, description: str | None = None) -> Any:
    return group.add_parser(
        name, help=help, description=description or help, formatter_class=HelpFormatter
    )


def connection_options(parser: argparse.ArgumentParser) -> None:
    """--url and --key-env, on `metering` itself and on each client command (either place)."""
    parser.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help=f"the metering server (default: ${URL_ENV}, else {DEFAULT_URL})",
    )
    parser.add_argument(
        "--key-env",
        metavar="NAME",
        default=argparse.SUPPRESS,
        help=f"the environment variable holding the bearer key: the admin key, or a user's "
        f"token for spend and usage (default: {KEY_ENV})",
    )


def format_option(parser: argparse.ArgumentParser, default: str = "table") -> None:
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=default,
        help="table: aligned columns; csv: a header line, then one line a row; json: the API's "
        f"own objects (default: {default})",
    )


def server_url(args: argparse.Namespace) -> str:
    return str(getattr(args, "url", None) or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")


def bearer_key(args: argparse.Namespace) -> str:
    name = getattr(args, "key_env", None) or KEY_ENV
    key = os.environ.get(name)
    if not key:
        raise CliError(
            f"set {name} to the admin key (or name the variable that holds a key with "
            "--key-env NAME)",
            code=2,
        )
    return key


def from_env(name: str, what: str) -> str:
    """A secret read from the variable `name` (never from the command line: shell history)."""
    value = os.environ.get(name)
    if not value:
        raise CliError(f"{name} is not set: it should hold the {what}", code=2)
    return value


# --- values of the options that may also be null (a limit removed, a list back to its default)


def nullable(convert: Callable[[str], Any], word: str) -> Callable[[str], Any]:
    """`word` is JSON null; anything else goes through `convert`."""

    def parse(value: str) -> Any:
        return None if value.strip().lower() == word else convert(value)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names it in its errors
    return parse


def whole(value: str) -> int:
    """A whole number as the API wants it (a JSON integer); the server checks its bounds."""
    return int(value.strip())


def positive(value: str) -> int:
    """A count of rows, events or a page number: 1 or more."""
    number = int(value.strip())
    if number < 1:
        raise ValueError(value)
    return number


def seconds(value: str) -> float:
    """A wait in seconds: more than 0, at most a day."""
    number = float(value.strip())
    if not 0 < number <= 86_400:
        raise ValueError(value)
    return number


def names(value: str) -> list[str]:
    """Comma-separated names, in order, without empties."""
    return [item.strip() for item in value.split(",") if item.strip()]


def percentages(value: str) -> list[int]:
    if value.strip().lower() == "none":
        return []
    return [int(item) for item in names(value)]


percentages.__name__ = "percentages"
