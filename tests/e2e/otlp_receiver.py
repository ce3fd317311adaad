"""A minimal OTLP/HTTP receiver: decodes what exporters POST and appends it as JSON lines.

    python tests/e2e/otlp_receiver.py --port 4318 --out /tmp/otlp.jsonl

Accepts ``/v1/metrics`` and ``/v1/traces`` (binary protobuf, optionally gzip) and answers with
the empty Export*ServiceResponse, as a collector does. Each line of ``--out`` is
``{"signal": "metrics"|"traces", "body": <the request as protobuf JSON>}``. A separate process,
so the tests exercise the real exporter's HTTP path, not an in-memory shortcut.
"""

from __future__ import annotations

import argparse
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

SIGNALS = {
    "/v1/metrics": ("metrics", ExportMetricsServiceRequest, ExportMetricsServiceResponse),
    "/v1/traces": ("traces", ExportTraceServiceRequest, ExportTraceServiceResponse),
}


def make_handler(out: Path) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            signal = SIGNALS.get(self.path)
            if signal is None:
                self.send_error(404)
                return
            name, request_type, response_type = signal
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            try:
                message = request_type.FromString(raw)
            except Exception as exc:
                self.send_error(400, f"not an OTLP protobuf body: {exc}")
                return
            line = json.dumps({"signal": name, "body": MessageToDict(message)})
            with lock, out.open("a") as f:
                f.write(line + "\n")
            payload = response_type().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.touch()
    ThreadingHTTPServer((args.host, args.port), make_handler(args.out)).serve_forever()


if __name__ == "__main__":
    main()
