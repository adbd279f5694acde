"""An answer relayed from upstream leaves nothing for the garbage collector: the upstream's
response, the aiohttp response and reader behind it and their headers are freed by reference
counting as the request ends (httpx's client binds a response and its stream into a cycle,
which `Upstreams.send` undoes). Cyclic garbage of every request kept the collector's young
generation full, and each of its passes stopped the server for 15-45 ms under load."""

import gc

import pytest

from tests.proxy.conftest import user_message

# The upstream client's own objects: nothing else in the test process makes them.
UPSTREAM = {
    "aiohttp.client_reqrep.ClientResponse",
    "aiohttp.streams.StreamReader",
    "httpx_aiohttp.transport.AiohttpResponseStream",
}


@pytest.mark.parametrize("stream", [False, True], ids=["completion", "stream"])
def test_a_relayed_answer_leaves_no_cyclic_garbage(http, stream):
    body = {"model": "gpt-sim", "messages": user_message("hi sim:tokens=5"), "stream": stream}
    assert http.post("/v1/chat/completions", json=body).status_code == 200  # warm
    gc.collect()
    flags = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a pass finds unreachable is kept here to be counted
    try:
        for _ in range(10):
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
        gc.collect()
        left = sorted(
            name
            for name in (f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
            if name in UPSTREAM
        )
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
    assert left == []
