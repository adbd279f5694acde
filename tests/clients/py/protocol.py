"""The loop every Python client script runs (each is spawned by tests/clients/ in the clients'
own virtualenv, .venv-clients): one JSON line on stdin per request, one JSON line on stdout per
answer; `{"ready": true}` first, once the client is imported and configured.

A request: {"op": "text" | "stream", "token": ..., "model": ..., "prompt": ...} (token and
model default to METERING_TOKEN and METERING_MODEL, its base_url (the server's URL, without
/v1) to METERING_BASE_URL). An answer: {"ok": true, "text", "model", "usage": {"prompt_tokens",
"completion_tokens", "total_tokens"} | null, "extra"} or {"ok": false, "error": the client's
exception class, "status": the HTTP status it carries, "message"}."""

import asyncio
import inspect
import json
import os
import sys
import traceback
from collections.abc import Callable

BASE_URL = os.environ["METERING_BASE_URL"].rstrip("/")


def usage(prompt, completion, total=None) -> dict | None:
    if prompt is None and completion is None and total is None:
        return None
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


def status_of(exc: BaseException) -> int | None:
    for name in ("status_code", "status", "http_status"):
        value = getattr(exc, name, None)
        if isinstance(value, int):
            return value
    response = getattr(exc, "response", None)
    value = getattr(response, "status_code", None)
    return value if isinstance(value, int) else None


def serve(ops: dict[str, Callable]) -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        step = json.loads(line)
        step.setdefault("token", os.environ.get("METERING_TOKEN"))
        step.setdefault("model", os.environ.get("METERING_MODEL"))
        step.setdefault("base_url", BASE_URL)
        step.setdefault("prompt", "Say hello. sim:tokens=12")
        try:
            answer = ops[step["op"]](step)
            if inspect.iscoroutine(answer):
                answer = asyncio.run(answer)
            out = {"ok": True, **answer}
        except Exception as exc:  # the client's own error, reported for the test to check
            out = {
                "ok": False,
                "error": f"{type(exc).__module__}.{type(exc).__qualname__}",
                "status": status_of(exc),
                "message": str(exc)[:2000],
                "trace": traceback.format_exc()[-3000:],
            }
        print(json.dumps(out, default=str), flush=True)
