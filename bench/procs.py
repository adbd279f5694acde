"""The servers under test as subprocesses, and what /proc says about a process."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parent.parent


def revision() -> str:
    """The commit measured, and whether the product's files differed from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "metering", "migrations", "pyproject.toml"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head} (with uncommitted changes)" if dirty else head or "unknown"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    # The command name may hold spaces and parentheses; the fields start after the last ')'.
    fields = data[data.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def tree(pid: int) -> list[int]:
    """pid and its descendants (uvicorn's workers when `--workers N` > 1)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            data = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(data[data.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU of the process and its live descendants (a worker that exited is not counted)."""
    return sum(cpu_of(tree(pid)).values())


def tree_rss_kib(pid: int) -> int:
    total = 0
    for member in tree(pid):
        with contextlib.suppress(OSError, RuntimeError):
            total += rss_kib(member)
    return total


def cpu_of(pids) -> dict[int, float]:
    """CPU seconds of each pid still alive."""
    out = {}
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            out[pid] = cpu_seconds(pid)
    return out


class Process:
    """One server subprocess; its output goes to a log file shown when it fails."""

    def __init__(self, name: str, argv: list[str], env: dict, cwd: Path, log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (open while the server runs)
        self.popen = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_http(self, url: str, headers: dict | None = None, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(url, headers=headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(
            f"{self.name} did not answer {url} within {timeout}s:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()


def metering_command() -> list[str]:
    """`metering` from the same environment as this Python, else the module."""
    script = Path(sys.executable).parent / "metering"
    return [str(script)] if script.exists() else [sys.executable, "-m", "metering.cli"]


def start_sim(tmp: Path, stack: contextlib.ExitStack, key: str) -> tuple["Process", int]:
    """The simulated upstream in its own process, stopped with `stack`; (process, port)."""
    port = free_port()
    sim = Process(
        "sim",
        [sys.executable, "-m", "metering.sim", "--port", str(port)],
        dict(os.environ),
        tmp,
        tmp,
    )
    stack.callback(sim.stop)
    sim.wait_http(
        f"http://127.0.0.1:{port}/openai/v1/models", headers={"authorization": f"Bearer {key}"}
    )
    return sim, port
