"""OpenTelemetry traces end to end: a metering server configured by the OTEL_* variables
exports its spans over OTLP/HTTP to a receiver in this process, which decodes them as a
collector would (opentelemetry-proto's ExportTraceServiceRequest). Each request is one span
with the GenAI attributes and the metering's own, its steps its children; the client's
traceparent is continued and the upstream gets the trace. Without the variables, nothing is
traced and no traceparent goes upstream."""

import gzip
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from metering.proxy.tracing import Tracing, configured
from metering.testing import free_port
from tests.proxy.conftest import (
    event_by_id,
    provider_entry,
    serving,
    sim_record,
    user,
    wait_events,
)

SERVER, CLIENT, INTERNAL = Span.SPAN_KIND_SERVER, Span.SPAN_KIND_CLIENT, Span.SPAN_KIND_INTERNAL
STEPS = ["admission", "hold", "upstream", "settle"]


class Receiver:
    """An OTLP/HTTP receiver on a loopback port: POST /v1/traces, protobuf bodies decoded."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict, Span]] = []  # (the resource's attributes, the span)
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces"
                if ok:
                    receiver.add(ExportTraceServiceRequest.FromString(body))
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope_spans.spans)

    def spans_of(self, trace_id: str, timeout: float = 10.0) -> list[Span]:
        """The spans of one trace, once its request's span (the last to end) came."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = [s for _, s in self.spans if s.trace_id.hex() == trace_id]
            if any(s.name.startswith("chat") for s in spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.02)

    def trace(self, trace_id: str) -> dict[str, Span]:
        """The spans of one trace by name (each name once)."""
        spans = self.spans_of(trace_id)
        by_name = {s.name: s for s in spans}
        assert len(by_name) == len(spans), [s.name for s in spans]
        return by_name

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(pairs) -> dict:
    out = {}
    for pair in pairs:
        kind = pair.value.WhichOneof("value")
        value = getattr(pair.value, kind)
        if kind == "array_value":
            value = [getattr(v, v.WhichOneof("value")) for v in value.values]
        out[pair.key] = value
    return out


def traceparent() -> tuple[str, str, str]:
    """A client's traceparent, its trace id and its span id."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.fixture(scope="module")
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def traced(api, sim, receiver):
    """A metering server whose OTEL_* variables send its traces to the receiver."""
    model = {"input_usd_per_mtok": "0.15", "output_usd_per_mtok": "0.60", "max_output_tokens": 4096}
    catalog = {
        "providers": {
            "sim-openai": provider_entry(sim.base_url("openai"), "openai"),
            # Nothing listens there: its requests fail before going out.
            "down": provider_entry(f"http://127.0.0.1:{free_port()}/v1", "openai"),
        },
        "models": [
            {**model, "name": "gpt-sim", "provider": "sim-openai", "upstream_model": "sim/gpt"},
            # Tried first (the cheaper), then the next.
            {**model, "name": "fallover", "provider": "down", "upstream_model": "down/m"},
            {
                **model,
                "name": "fallover",
                "provider": "sim-openai",
                "upstream_model": "sim/fallover",
                "output_usd_per_mtok": "0.70",
            },
        ],
    }
    with pytest.MonkeyPatch.context() as env:
        for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_RESOURCE_ATTRIBUTES"):
            env.delenv(name, raising=False)
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        env.setenv("OTEL_SERVICE_NAME", "metering-under-test")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # milliseconds between exports
        with serving(api, catalog) as own:
            yield own


def assert_steps(spans: dict[str, Span], root: Span) -> None:
    """admission, hold, upstream and settle: children of the request's span, in that order."""
    assert sorted(spans) == sorted([root.name, *STEPS])
    steps = [spans[name] for name in STEPS]
    for step in steps:
        assert step.parent_span_id == root.span_id
        assert step.trace_id == root.trace_id
        assert root.start_time_unix_nano <= step.start_time_unix_nano
        assert step.end_time_unix_nano <= root.end_time_unix_nano
    assert [s.kind for s in steps] == [INTERNAL, INTERNAL, CLIENT, INTERNAL]
    starts = [s.start_time_unix_nano for s in steps]
    assert starts == sorted(starts)
    assert spans["upstream"].end_time_unix_nano <= spans["settle"].start_time_unix_nano


def assert_settled(root: dict, event: dict, record: dict) -> None:
    """The request's span says what the ledger and the upstream say."""
    assert root["gen_ai.usage.input_tokens"] == event["prompt_tokens"]
    assert root["gen_ai.usage.output_tokens"] == event["completion_tokens"]
    assert record["usage"]["completion_tokens"] == event["completion_tokens"]
    assert Decimal(root["metering.cost"]) == Decimal(event["cost"]) > 0
    assert root["metering.usage.source"] == "reported"
    assert root["metering.status"] == "ok"
    assert root["gen_ai.response.id"] == record["id"]
    assert root["gen_ai.response.finish_reasons"] == ["stop"]


def test_a_completion_is_one_span_continuing_the_clients_trace(traced, sim, receiver):
    team, person, token = traced.principal()
    header, trace_id, client_span = traceparent()
    raw = traced.openai(token["token"]).chat.completions.with_raw_response.create(
        model="gpt-sim",
        messages=user("Hi sim:tokens=3"),
        max_tokens=20,
        extra_headers={"traceparent": header, "tracestate": "vendor=kept"},
    )
    completion = raw.parse()
    request_id = raw.headers["x-request-id"]
    spans = receiver.trace(trace_id)
    root = spans["chat gpt-sim"]
    assert root.kind == SERVER
    assert root.parent_span_id.hex() == client_span  # the client's span is its parent
    assert root.status.code == Status.STATUS_CODE_UNSET
    assert_steps(spans, root)

    got = attributes(root.attributes)
    assert got["gen_ai.operation.name"] == "chat"
    assert got["gen_ai.system"] == "openai"
    assert got["gen_ai.request.model"] == "gpt-sim"
    assert got["gen_ai.request.max_tokens"] == 20
    assert got["gen_ai.response.model"] == "sim/gpt"
    assert (got["metering.team_id"], got["metering.user_id"], got["metering.token_id"]) == (
        team["id"],
        person["id"],
        token["id"],
    )
    assert got["metering.request_id"] == request_id
    assert got["metering.provider"] == "sim-openai"
    assert got["metering.budget.decision"] == "allowed"
    assert got["metering.stream"] is False
    assert got["http.response.status_code"] == 200
    assert completion.usage is not None
    assert got["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens == 3
    record = sim_record(sim, completion.id)
    assert_settled(got, event_by_id(traced, token["id"], request_id), record)
    assert attributes(spans["hold"].attributes)["metering.budget.decision"] == "allowed"
    assert attributes(spans["upstream"].attributes)["http.response.status_code"] == 200

    # The upstream continues the trace from the upstream call's span, the client's state kept.
    upstream = spans["upstream"]
    assert record["headers"]["traceparent"] == f"00-{trace_id}-{upstream.span_id.hex()}-01"
    assert record["headers"]["tracestate"] == "vendor=kept"
    assert upstream.trace_state == "vendor=kept"
    resources = [r for r, s in receiver.spans if s.span_id == root.span_id]
    assert resources[0]["service.name"] == "metering-under-test"


def test_a_streamed_completion_span_ends_when_its_stream_has_settled(traced, sim, receiver):
    team, person, token = traced.principal()
    header, trace_id, _ = traceparent()
    stream = traced.openai(token["token"]).chat.completions.create(
        model="gpt-sim",
        messages=user("Hi sim:tokens=5"),
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"traceparent": header},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 5
    spans = receiver.trace(trace_id)
    root = spans["chat gpt-sim"]
    assert_steps(spans, root)
    got = attributes(root.attributes)
    assert got["metering.stream"] is True
    assert got["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert got["gen_ai.usage.output_tokens"] == 5
    [event] = wait_events(traced, token["id"], 1)
    assert got["metering.request_id"] == event["id"]
    assert_settled(got, event, sim_record(sim, chunks[0].id))
    # The settle came after the stream's last upstream byte, and the request's span ends after.
    assert spans["settle"].end_time_unix_nano <= root.end_time_unix_nano


def test_a_refused_request_says_which_budget_refused_it(traced, sim, receiver):
    team, person, token = traced.principal(user_limit="0.000001")
    header, trace_id, _ = traceparent()
    before = len(sim.log())
    with pytest.raises(openai.APIStatusError) as refused:
        traced.openai(token["token"]).chat.completions.create(
            model="gpt-sim",
            messages=user("Hi sim:tokens=3"),
            max_tokens=50,
            extra_headers={"traceparent": header},
        )
    assert refused.value.status_code == 402
    spans = receiver.trace(trace_id)
    root = spans["chat gpt-sim"]
    # Refused at the hold: nothing went upstream, nothing was settled.
    assert sorted(spans) == ["admission", "chat gpt-sim", "hold"]
    assert len(sim.log()) == before
    assert root.status.code == Status.STATUS_CODE_ERROR
    assert "user budget" in root.status.message
    got = attributes(root.attributes)
    assert got["metering.budget.decision"] == "refused"
    assert got["metering.budget.scope"] == "user"
    assert got["metering.refusal.reason"] == "budget"
    assert got["error.type"] == "budget_exceeded"
    assert got["http.response.status_code"] == 402
    assert got["metering.user_id"] == person["id"]
    assert "gen_ai.usage.input_tokens" not in got
    hold = spans["hold"]
    assert hold.parent_span_id == root.span_id
    assert hold.status.code == Status.STATUS_CODE_ERROR


def test_a_compressed_request_taking_the_general_stack_is_traced_too(traced, receiver):
    token = traced.principal()[2]
    header, trace_id, client_span = traceparent()
    body = json.dumps({"model": "gpt-sim", "messages": user("Hi sim:tokens=2")}).encode()
    answer = traced.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        content=gzip.compress(body),
        headers={
            "content-type": "application/json",
            "content-encoding": "gzip",
            "traceparent": header,
        },
    )
    assert answer.status_code == 200, answer.text
    spans = receiver.trace(trace_id)
    root = spans["chat gpt-sim"]
    assert root.parent_span_id.hex() == client_span
    assert_steps(spans, root)
    got = attributes(root.attributes)
    assert got["metering.request_id"] == answer.headers["x-request-id"]
    assert got["http.response.status_code"] == 200
    assert got["gen_ai.usage.output_tokens"] == answer.json()["usage"]["completion_tokens"] == 2


def test_a_request_that_falls_over_has_the_steps_of_each_attempt(traced, receiver):
    token = traced.principal()[2]
    header, trace_id, _ = traceparent()
    raw = traced.openai(token["token"]).chat.completions.with_raw_response.create(
        model="fallover", messages=user("Hi sim:tokens=2"), extra_headers={"traceparent": header}
    )
    spans = receiver.spans_of(trace_id)
    [root] = [s for s in spans if s.name == "chat fallover"]
    steps = sorted((s for s in spans if s is not root), key=lambda s: s.start_time_unix_nano)
    assert all(s.parent_span_id == root.span_id for s in steps)
    # The first provider could not be reached: its hold released; the second answered.
    assert [s.name for s in steps] == [
        "admission",
        "hold",
        "upstream",
        "release",
        "admission",
        "hold",
        "upstream",
        "settle",
    ]
    first, second = steps[2], steps[6]
    assert first.status.code == Status.STATUS_CODE_ERROR
    assert attributes(first.attributes)["error.type"] == "unreached"
    assert attributes(first.attributes)["metering.provider"] == "down"
    assert attributes(second.attributes)["metering.provider"] == "sim-openai"
    assert second.status.code == Status.STATUS_CODE_UNSET
    got = attributes(root.attributes)
    assert got["metering.provider"] == "sim-openai"
    assert got["gen_ai.response.model"] == "sim/fallover"
    assert got["metering.request_id"] == raw.headers["x-request-id"]
    assert got["metering.request_id"].endswith("_2")
    assert root.status.code == Status.STATUS_CODE_UNSET


def test_without_otel_variables_nothing_is_traced_and_no_traceparent_goes_up(api, sim):
    token = api.principal()[2]
    header, _, _ = traceparent()
    completion = api.openai(token["token"]).chat.completions.create(
        model="gpt-sim", messages=user("Hi sim:tokens=2"), extra_headers={"traceparent": header}
    )
    record = sim_record(sim, completion.id)
    assert record["status"] == 200
    assert "traceparent" not in record["headers"]


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, False),
        ({"OTEL_SERVICE_NAME": "metering"}, False),
    ],
)
def test_traces_are_on_only_when_an_otlp_exporter_is_configured(environ, on):
    assert configured(environ) is on


def test_without_otel_variables_the_sdk_is_not_even_loaded(tmp_path):
    script = (
        "import sys\n"
        "from metering.app import create_app\n"
        "from metering.settings import Settings\n"
        f"app = create_app(Settings(_env_file=None, database_url='sqlite:///{tmp_path}/m.db'))\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk'))\n"
        "print(loaded)\n"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environ, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("environ", "service"),
    [
        ({}, "metering"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes,team=llm"}, "from-attributes"),
        ({"OTEL_SERVICE_NAME": "named", "OTEL_RESOURCE_ATTRIBUTES": "team=llm"}, "named"),
    ],
)
def test_the_service_name_is_the_operators_else_metering(monkeypatch, environ, service):
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    tracing = Tracing.from_environ()
    assert tracing is not None
    try:
        assert tracing.provider.resource.attributes["service.name"] == service
    finally:
        tracing.shutdown()
