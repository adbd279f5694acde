"""Every command of `metering` says what each of its options is and its default; the admin
client's commands load no part of the server."""

import argparse
import subprocess
import sys

import pytest

from metering.cli import parser

SERVER_STACK = ("fastapi", "sqlalchemy", "alembic", "uvicorn", "starlette", "asyncpg")


def commands(top: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(the words of the command, its parser) of every command that runs (the leaves)."""
    groups = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield path, top
    for group in groups:
        for name, sub in group.choices.items():
            yield from commands(sub, (*path, name))


COMMANDS = dict(commands(parser()))


def test_the_admin_client_and_the_servers_commands_are_there():
    names = {" ".join(words) for words in COMMANDS}
    for kind in ("teams", "users", "tokens"):
        assert {f"{kind} {c}" for c in ("list", "get", "create", "update", "delete")} <= names
    assert {"webhooks list", "webhooks create", "webhooks delete", "webhooks test"} <= names
    assert {"spend", "usage", "serve", "demo", "db upgrade", "reconcile", "rerate"} <= names


@pytest.mark.parametrize("words", list(COMMANDS), ids=" ".join)
def test_every_option_has_its_help_and_its_default(words, capsys):
    command = COMMANDS[words]
    with pytest.raises(SystemExit) as done:
        parser().parse_args([*words, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    packed = "".join(out.split())  # argparse wraps lines, at spaces and hyphens
    for action in command._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, (words, action.dest)
        assert "".join(action.help.split()) in packed, (words, action.dest)
        for flag in action.option_strings:
            assert flag in out, (words, flag)
        if action.option_strings:
            # what the option is when not given, or that it must be given
            said = help_of(command, action)
            assert "default" in said or "(required)" in said, (words, action.dest, said)


def help_of(command: argparse.ArgumentParser, action: argparse.Action) -> str:
    return command._get_formatter()._get_help_string(action) or ""


def test_serve_and_demo_show_their_defaults(capsys):
    for words, expected in (
        (["serve"], ("(default: 127.0.0.1)", "(default: 8080)", "(default: 1)", "(default: info)")),
        (["demo"], ("(default: 127.0.0.1)", "(default: 8080)", "kept in it")),
    ):
        with pytest.raises(SystemExit):
            parser().parse_args([*words, "--help"])
        shown = " ".join(capsys.readouterr().out.split())
        for text in expected:
            assert text in shown, (words, text)


@pytest.mark.e2e  # starts an interpreter; the request goes to a port nothing listens on
def test_the_client_commands_load_no_part_of_the_server():
    script = (
        "import sys\n"
        "from metering.cli import main\n"
        "code = main(['--url', 'http://127.0.0.1:1', 'teams', 'list'])\n"
        "print(code, sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:])))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, *SERVER_STACK],
        capture_output=True,
        text=True,
        timeout=60,
        env={"METERING_ADMIN_KEY": "any", "PATH": ""},
    )
    assert done.stdout == "1 []\n", done.stderr
    assert "cannot connect to http://127.0.0.1:1" in done.stderr
