"""OpenTelemetry traces of proxied chat completions, exported over OTLP/HTTP: off unless the
operator configures an OTLP exporter with the standard OTEL_* variables (docs/operator/
tracing.md).

When it is off there is no Tracing (the container's `tracing` is None): the proxy's path checks
that once per request and per step and calls nothing of OpenTelemetry. When it is on, each
request is one span named `chat {model}` (the GenAI semantic conventions, with the metering's
own attributes), continuing the client's W3C `traceparent`; each attempt adds its spans:
`admission` (rate and parallel limits), `hold` (the budget reservation), `upstream` (the
provider's call, whose `traceparent` it sends) and `settle` (or `release` when nothing went
out). A streamed answer's span ends when its stream has ended and settled.

The provider is this process's own, not OpenTelemetry's global one: several servers of one
process (the tests) each export with their own settings, and libraries that trace through the
global provider are left as the operator set them.
"""

import logging
import os
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from metering.auth.principal import Principal
from metering.money import format_usd

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from metering.ledger.event import Event
    from metering.proxy.request import ChatRequest
    from metering.proxy.runtime import Answer
    from metering.settings import ModelRoute, Provider

log = logging.getLogger("metering.proxy")

SCOPE = "metering.proxy"
SERVICE = "metering"
TRUE = ("true", "1", "yes", "on")
_PROPAGATOR = TraceContextTextMapPropagator()


def configured(environ: Mapping[str, str]) -> bool:
    """Whether the OTEL_* variables ask for traces: an OTLP endpoint, or OTEL_TRACES_EXPORTER
    otlp; never when OTEL_SDK_DISABLED is true or OTEL_TRACES_EXPORTER is none."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() in TRUE:
        return False
    exporters = {
        name.strip().lower()
        for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",")
        if name.strip()
    }
    if "none" in exporters:
        return False
    if exporters:
        if exporters != {"otlp"}:
            log.warning(
                "OTEL_TRACES_EXPORTER=%s: only otlp is supported",
                environ.get("OTEL_TRACES_EXPORTER"),
            )
        return "otlp" in exporters
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


class Tracing:
    """The tracer of this process: its provider exports in batches (BatchSpanProcessor) from a
    thread of its own; shutdown() sends what is left."""

    def __init__(self, provider: "TracerProvider") -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(SCOPE)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Tracing | None":
        """A Tracing when the OTEL_* variables configure one (os.environ's unless given), else
        None. The SDK reads the rest of its configuration from os.environ itself: endpoint,
        headers, timeout, compression, OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES,
        OTEL_TRACES_SAMPLER, the batch processor's OTEL_BSP_*."""
        if not configured(os.environ if environ is None else environ):
            return None
        # Imported only when traces are on: a server without them loads none of the SDK.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        protocol = os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
        )
        if protocol not in ("", "http/protobuf"):
            log.warning("OTLP protocol %s is not supported: traces go as http/protobuf", protocol)
        # OTEL_SERVICE_NAME, else OTEL_RESOURCE_ATTRIBUTES' service.name, else "metering".
        resource = Resource.create()
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": SERVICE}))
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider)

    async def traced(
        self,
        headers: Mapping[str, str],
        principal: Principal,
        serve: Callable[["RequestTrace"], Awaitable["Answer"]],
    ) -> "Answer":
        """`serve(trace)` within the request's span, which ends when its answer has been sent
        (the stream's end) or when serving raised."""
        request = RequestTrace(self.tracer, headers, principal)
        try:
            answer = await serve(request)
        except BaseException as exc:
            request.failed(exc)
            request.end()
            raise
        return TracedAnswer(answer, request)

    def shutdown(self) -> None:
        """Export what is left, then stop the exporting thread (the server's shutdown)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's span, and its attempts' spans under it."""

    __slots__ = ("tracer", "span", "context", "error", "message")

    def __init__(self, tracer: trace.Tracer, headers: Mapping[str, str], principal: Principal):
        self.tracer = tracer
        # The client's traceparent and tracestate (W3C), continued; a new trace without them.
        parent = _PROPAGATOR.extract(headers)
        self.span = tracer.start_span(
            "chat",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": "chat",
                "metering.team_id": principal.team_id or "",
                "metering.user_id": principal.user_id or "",
                "metering.token_id": principal.token_id or "",
            },
        )
        self.context = trace.set_span_in_context(self.span, parent)
        self.error: str | None = None  # error.type, once the request failed
        self.message: str | None = None

    def requested(self, chat: "ChatRequest") -> None:
        """The validated request: its model names the span."""
        span = self.span
        span.update_name(f"chat {chat.model}")
        span.set_attribute("gen_ai.request.model", chat.model)
        span.set_attribute("metering.stream", chat.stream)
        if chat.max_tokens is not None:
            span.set_attribute("gen_ai.request.max_tokens", chat.max_tokens)

    def attempt(self, attempt_id: str, route: "ModelRoute", dialect: str) -> None:
        """The attempt being made (the last one made is the one that answered)."""
        span = self.span
        span.set_attribute("gen_ai.system", dialect)
        span.set_attribute("gen_ai.provider.name", dialect)
        span.set_attribute("metering.provider", route.provider)
        span.set_attribute("metering.model", route.name)
        span.set_attribute("metering.request_id", attempt_id)

    def step(self, name: str, kind: SpanKind = SpanKind.INTERNAL) -> Span:
        """A span of one step under the request's (ended by its `with` or by end())."""
        return self.tracer.start_span(name, context=self.context, kind=kind)

    def allowed(self, hold: Span) -> None:
        hold.set_attribute("metering.budget.decision", "allowed")
        self.span.set_attribute("metering.budget.decision", "allowed")

    def upstream(self, provider: "Provider", headers: MutableMapping[str, str]) -> Span:
        """The provider's call: its span, whose traceparent (and the client's tracestate) the
        upstream request's `headers` carry."""
        span = self.tracer.start_span(
            "upstream",
            context=self.context,
            kind=SpanKind.CLIENT,
            attributes={"metering.provider": provider.name, "http.request.method": "POST"},
        )
        _PROPAGATOR.inject(headers, trace.set_span_in_context(span, self.context))
        return span

    def settled(self, event: "Event") -> None:
        """What the ledger recorded of the attempt that answered."""
        span = self.span
        span.set_attribute("gen_ai.response.model", event.upstream_model)
        if event.upstream_id:
            span.set_attribute("gen_ai.response.id", event.upstream_id)
        if event.finish_reason:
            span.set_attribute("gen_ai.response.finish_reasons", (event.finish_reason,))
        span.set_attribute("gen_ai.usage.input_tokens", event.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", event.completion_tokens)
        span.set_attribute("metering.cost", format_usd(event.cost))
        span.set_attribute("metering.usage.source", event.usage_source)
        span.set_attribute("metering.status", event.status)
        if event.status != "ok":
            self.error = event.status

    def failed(self, exc: BaseException) -> None:
        """The request ended in an error of the proxy's (a refusal, a failed upstream) or an
        exception."""
        span = self.span
        refused = getattr(exc, "refused", None)
        if refused is not None:
            span.set_attribute("metering.refusal.reason", refused.reason)
            span.set_attribute("metering.refusal.scope", refused.scope)
            if refused.reason == "budget":
                span.set_attribute("metering.budget.decision", "refused")
                span.set_attribute("metering.budget.scope", refused.scope)
        status = getattr(exc, "status", None)
        if isinstance(status, int):
            span.set_attribute("http.response.status_code", status)
        self.error = getattr(exc, "code", None) or type(exc).__qualname__
        self.message = str(getattr(exc, "message", None) or exc)[:500]

    def answered(self, status: int) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 400 and self.error is None:
            self.error = str(status)

    def end(self) -> None:
        span = self.span
        if self.error is not None:
            span.set_attribute("error.type", self.error)
            span.set_status(Status(StatusCode.ERROR, self.message))
        span.end()


class TracedAnswer(Response):
    """An answer whose sending ends the request's span (a stream's, once it has settled)."""

    def __init__(self, answer: "Answer", request: RequestTrace) -> None:
        self.answer, self.request = answer, request
        self.status_code = getattr(answer, "status_code", 200)
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = self.request

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                request.answered(message["status"])
            await send(message)

        try:
            await self.answer(scope, receive, watched)
        except BaseException as exc:
            request.failed(exc)
            raise
        finally:
            request.end()
