"""Top functions of a py-spy recording in collapsed-stack form (`py-spy record --format raw`,
as `python -m bench.run --profile PATH` makes): python -m bench.hotspots PATH.postgresql.txt

Self time is where the samples' innermost frame was; inclusive time counts a function once
per sample it is anywhere on the stack. Both in percent of all samples."""

import argparse
import re
from collections import Counter

_LINE = re.compile(r"\s*\(([^()]*?)(?::\d+)?\)$")


def frame_name(frame: str) -> str:
    """'func (path/file.py:12)' -> 'func (path/file.py)': one entry per function, not per line."""
    match = _LINE.search(frame)
    if not match:
        return frame.strip()
    return f"{frame[: match.start()].strip()} ({match.group(1)})"


# Where a sample's innermost frame lives, by the file's path; first match wins.
PACKAGES = (
    ("sqlalchemy/", "SQLAlchemy (statement building, compiling, ORM, result handling)"),
    ("asyncpg/", "asyncpg (protocol, incl. its socket writes)"),
    ("aiosqlite/", "aiosqlite / sqlite3"),
    ("sqlite3/", "aiosqlite / sqlite3"),
    ("greenlet", "SQLAlchemy (statement building, compiling, ORM, result handling)"),
    ("httpx", "upstream client (httpx, httpx-aiohttp, aiohttp)"),
    ("aiohttp/", "upstream client (httpx, httpx-aiohttp, aiohttp)"),
    ("yarl/", "upstream client (httpx, httpx-aiohttp, aiohttp)"),
    ("multidict/", "upstream client (httpx, httpx-aiohttp, aiohttp)"),
    ("uvicorn/", "HTTP server (uvicorn, starlette, fastapi, pydantic)"),
    ("starlette/", "HTTP server (uvicorn, starlette, fastapi, pydantic)"),
    ("fastapi/", "HTTP server (uvicorn, starlette, fastapi, pydantic)"),
    ("pydantic", "HTTP server (uvicorn, starlette, fastapi, pydantic)"),
    ("anyio/", "HTTP server (uvicorn, starlette, fastapi, pydantic)"),
    ("metering/", "metering's own code"),
    ("asyncio/", "event loop (uvloop: socket I/O, callbacks)"),
)


def package_of(frame: str) -> str:
    for needle, name in PACKAGES:
        if needle in frame:
            return name
    return "other"


def summarize(path: str) -> tuple[int, Counter, Counter, Counter]:
    total, own, inclusive, packages = 0, Counter(), Counter(), Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            # py-spy --subprocesses puts a "process PID:CMDLINE" frame at the root.
            frames = [
                frame_name(frame)
                for frame in stack.split(";")
                if frame.strip() and not frame.startswith("process ")
            ]
            frames = frames or ["<no Python frame: native code, GC>"]
            total += n
            own[frames[-1]] += n
            packages[package_of(frames[-1])] += n
            for name in set(frames):
                inclusive[name] += n
    return total, own, inclusive, packages


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hotspots", description=__doc__)
    p.add_argument("path")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--match", help="inclusive list: only functions whose text contains this")
    args = p.parse_args()
    total, own, inclusive, packages = summarize(args.path)
    print(f"{total} samples\n\nself time by package:")
    for name, n in packages.most_common():
        print(f"{100 * n / total:6.1f}%  {name}")
    print("\nself time:")
    for name, n in own.most_common(args.top):
        print(f"{100 * n / total:6.1f}%  {name}")
    print("\ninclusive time:")
    shown = 0
    for name, n in inclusive.most_common():
        if args.match and args.match not in name:
            continue
        print(f"{100 * n / total:6.1f}%  {name}")
        shown += 1
        if shown >= args.top:
            break


if __name__ == "__main__":
    main()
