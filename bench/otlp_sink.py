"""A local OTLP/HTTP trace receiver for bench.run's traced row: it takes POST /v1/traces as a
collector would (protobuf, decoded), keeps nothing but counts, and answers GET /stats with
them. Run as `python -m bench.otlp_sink --port PORT`."""

import argparse
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Counts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.exports = self.spans = self.requests = self.bytes = 0

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = [
            span
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        with self.lock:
            self.exports += 1
            self.bytes += len(body)
            self.spans += len(spans)
            self.requests += sum(span.name.startswith("chat ") for span in spans)

    def as_dict(self) -> dict[str, int]:
        with self.lock:
            return {
                "exports": self.exports,
                "spans": self.spans,
                "requests": self.requests,
                "bytes": self.bytes,
            }


def serve(port: int) -> None:
    counts = Counts()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            found = self.path == "/v1/traces"
            if found:
                counts.add(body)
            self._answer(200 if found else 404, b"", "application/x-protobuf")

        def do_GET(self) -> None:
            if self.path != "/stats":
                self._answer(404, b"", "text/plain")
                return
            self._answer(200, json.dumps(counts.as_dict()).encode(), "application/json")

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.otlp_sink", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    serve(parser.parse_args().port)


if __name__ == "__main__":
    main()
