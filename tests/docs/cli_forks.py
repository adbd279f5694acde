"""The pages' `metering` commands, each in a process of its own forked from one that has
already imported the CLI and httpx: a `metering` started from nothing spends ~0.25 s of CPU
importing them, and the pages run ~90 of them.

`serve(path)` is that process (`python -m tests.docs.cli_forks SOCKET`): for each connection
it forks a child that takes the caller's standard input, output and error (passed over the
Unix socket), its arguments, environment and working directory, runs metering.cli.main as
the `metering` script would (or a page's Python block, as the interpreter would: the
pages' SDK blocks import `openai`, a second of CPU each), and sends back its exit status. CLIENT is the caller: run by
`python -I -S` (no site-packages: it starts in milliseconds), from a shell function named
`metering`, so the pages' commands stay as printed (pipes, redirections, `$(...)`)."""

import contextlib
import os
import runpy
import signal
import socket
import struct
import sys
import threading
import traceback

PYTHON = "--python"  # the first argument of a request to run a Python file
CLIENT = r"""
import os, socket, struct, sys
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(os.environ["METERING_CLI_FORKS"])
env = "\0".join(f"{k}={v}" for k, v in os.environ.items())
request = "\1".join([os.getcwd(), env, *sys.argv[1:]]).encode("utf-8", "surrogateescape")
socket.send_fds(conn, [struct.pack("!I", len(request))], [0, 1, 2])
conn.sendall(request)
status = b""
while len(status) < 4:
    chunk = conn.recv(4 - len(status))
    if not chunk:
        sys.exit("metering: the command's process ended without an exit status")
    status += chunk
sys.exit(struct.unpack("!i", status)[0])
"""


def read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def run_one(conn: socket.socket) -> None:
    """In the forked child: become the caller's `metering` command (or, its arguments
    starting with PYTHON, the interpreter running a page's block), then exit."""
    code = 1
    try:
        header, fds, _, _ = socket.recv_fds(conn, 4, 3)
        (size,) = struct.unpack("!I", header)
        cwd, env, *argv = read_exactly(conn, size).decode("utf-8", "surrogateescape").split("\1")
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own, left open)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(item.partition("=")[::2] for item in env.split("\0") if "=" in item)
        try:
            if argv[:1] == [PYTHON]:  # a page's SDK block, as `python block.py` runs it
                sys.argv = argv[1:]
                sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))
                runpy.run_path(argv[1], run_name="__main__")
                code = 0
            else:
                sys.argv = ["metering", *argv]
                from metering.cli import main

                code = main(argv)
        except SystemExit as exc:  # argparse's --help and usage errors
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError):
                stream.flush()
        try:
            conn.sendall(struct.pack("!i", code))
        finally:
            os._exit(0)


def serve(path: str) -> None:
    # Imported once, here, for every child: the client, and what the local commands the pages
    # run (reconcile, rerate, migrate) load. Nothing here starts a thread: the children are
    # forked from a process of one.
    import httpx  # noqa: F401
    import openai  # noqa: F401 (the SDK blocks': an import of a second of CPU)

    import metering.billing.rerate
    import metering.cli
    import metering.db
    import metering.migrate
    import metering.reports.reconciliation
    import metering.settings  # noqa: F401

    assert threading.active_count() == 1, threading.enumerate()

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            run_one(conn)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
