"""OpenTelemetry export: agentkv's metrics and one span per pause -> resume cycle, over OTLP.

Primitives:
  otel_configured(env)       True when the standard ``OTEL_*`` variables ask for an OTLP export
  OTelExport.from_env(gauges)  -> OTelExport or None (not configured, or the SDK is missing);
                             reads endpoint, headers, protocol, service name, export interval from
                             the standard variables, nothing of its own; ``span_exporter`` and
                             ``metric_reader`` replace the OTLP ones (tests use in-memory ones)
  OTelExport.add / observe   the MetricsSink protocol: counters and histograms as they happen
  OTelExport.start_pause(key, attributes) / end_pause(key, attributes)
                             the ``agentkv.tool_wait`` span of one branch's pause; a second
                             start for the same key ends the first (status "superseded")
  OTelExport.shutdown()      flush and stop the exporters

Private providers, never the global ones: vLLM (``--otlp-traces-endpoint``) or the user's code
may own those, and agentkv must not replace them. Gauges are observed through callbacks that
read the engine's state at export time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from agentkv.metrics import METRICS, MetricSpec

log = logging.getLogger("agentkv.otel")

GaugeReader = Callable[[], Iterable[tuple[MetricSpec, Mapping[str, str], float]]]
MAX_OPEN_SPANS = 100_000


def _enabled(env: Mapping[str, str], signal: str) -> bool:
    if env.get(f"OTEL_{signal}_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    )


def otel_configured(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return _enabled(env, "METRICS") or _enabled(env, "TRACES")


class OTelExport:
    def __init__(
        self,
        gauges: GaugeReader,
        env: Mapping[str, str],
        span_exporter: Any = None,
        metric_reader: Any = None,
    ) -> None:
        from opentelemetry.sdk.resources import Resource

        from agentkv import __version__

        attrs: dict[str, Any] = {"service.version": __version__}
        if not env.get("OTEL_SERVICE_NAME"):
            attrs["service.name"] = "agentkv"
        resource = Resource.create(attrs)
        grpc = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf").strip() == "grpc"
        self._lock = threading.Lock()
        self._instruments: dict[str, Any] = {}
        self._spans: dict[tuple[str, str], Any] = {}
        self.meter_provider: Any = None
        self.tracer_provider: Any = None
        self._tracer: Any = None
        if _enabled(env, "METRICS"):
            self._start_metrics(resource, grpc, gauges, metric_reader)
        if _enabled(env, "TRACES"):
            self._start_traces(resource, grpc, span_exporter)

    def _start_metrics(self, resource: Any, grpc: bool, gauges: GaugeReader, reader: Any) -> None:
        """A meter provider exporting over OTLP (or to ``reader``) with one instrument per
        METRICS entry; gauges are read through ``gauges`` at each export."""
        from opentelemetry.metrics import CallbackOptions, Observation
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        from agentkv import __version__

        if reader is None:
            if grpc:
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                    OTLPMetricExporter,
                )
            else:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # type: ignore[assignment]
                    OTLPMetricExporter,
                )
            reader = PeriodicExportingMetricReader(OTLPMetricExporter())
        self.meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
        meter = self.meter_provider.get_meter("agentkv", __version__)

        def gauge_callback(spec: MetricSpec) -> Callable[[CallbackOptions], list[Observation]]:
            def cb(_: CallbackOptions) -> list[Observation]:
                try:
                    return [
                        Observation(value, dict(labels))
                        for s, labels, value in gauges()
                        if s is spec
                    ]
                except Exception:  # an export must never disturb the engine
                    log.debug("agentkv: gauge read failed", exc_info=True)
                    return []

            return cb

        for spec in METRICS:
            if spec.kind == "counter":
                inst = meter.create_counter(spec.otel_name, spec.unit, spec.help)
            elif spec.kind == "histogram":
                inst = meter.create_histogram(
                    spec.otel_name,
                    spec.unit,
                    spec.help,
                    explicit_bucket_boundaries_advisory=list(spec.buckets),
                )
            else:
                inst = meter.create_observable_gauge(
                    spec.otel_name, [gauge_callback(spec)], spec.unit, spec.help
                )
            self._instruments[spec.name] = inst

    def _start_traces(self, resource: Any, grpc: bool, exporter: Any) -> None:
        """A tracer provider exporting spans over OTLP (or to ``exporter``) in batches."""
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from agentkv import __version__

        if exporter is None:
            if grpc:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter,
                )
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                    OTLPSpanExporter,
                )
            exporter = OTLPSpanExporter()
        self.tracer_provider = TracerProvider(resource=resource)
        self.tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self.tracer_provider.get_tracer("agentkv", __version__)

    @classmethod
    def from_env(
        cls,
        gauges: GaugeReader,
        env: Mapping[str, str] | None = None,
        *,
        span_exporter: Any = None,
        metric_reader: Any = None,
    ) -> OTelExport | None:
        env = dict(os.environ if env is None else env)
        if not otel_configured(env):
            return None
        try:
            return cls(gauges, env, span_exporter, metric_reader)
        except ImportError as exc:
            log.warning(
                "agentkv: OTEL_* asks for an OTLP export but the SDK is missing (%s); "
                "install vllm-agentkv[otel]",
                exc,
            )
        except Exception as exc:
            log.warning("agentkv: OpenTelemetry export disabled: %s", exc)
        return None

    # ------------------------------------------------------------------ MetricsSink

    def add(self, spec: MetricSpec, value: float, labels: Mapping[str, str]) -> None:
        inst = self._instruments.get(spec.name)
        if inst is not None:
            inst.add(value, dict(labels))

    def observe(self, spec: MetricSpec, value: float, labels: Mapping[str, str]) -> None:
        inst = self._instruments.get(spec.name)
        if inst is not None:
            inst.record(value, dict(labels))

    # ------------------------------------------------------------------ spans

    def start_pause(self, key: tuple[str, str], attributes: Mapping[str, Any]) -> None:
        """Open the tool-wait span of ``key`` = (trajectory id, branch)."""
        if self._tracer is None:
            return
        span = self._tracer.start_span(
            "agentkv.tool_wait", attributes=_clean(attributes), start_time=time.time_ns()
        )
        with self._lock:
            old = self._spans.pop(key, None)
            if len(self._spans) >= MAX_OPEN_SPANS:
                # A harness that pauses and never resumes or ends must not grow this forever.
                self._spans.pop(next(iter(self._spans))).end()
            self._spans[key] = span
        if old is not None:
            old.set_attribute("agentkv.outcome", "superseded")
            old.end()

    def end_pause(self, key: tuple[str, str], attributes: Mapping[str, Any]) -> bool:
        """Close the span of ``key`` with ``attributes``; False when none was open."""
        with self._lock:
            span = self._spans.pop(key, None)
        if span is None:
            return False
        span.set_attributes(_clean(attributes))
        span.end()
        return True

    def shutdown(self) -> None:
        with self._lock:
            spans, self._spans = list(self._spans.values()), {}
        for span in spans:
            span.set_attribute("agentkv.outcome", "shutdown")
            span.end()
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None:
                try:
                    provider.shutdown()
                except Exception as exc:
                    log.debug("agentkv: OTel shutdown: %s", exc)


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """OTel attributes take str/bool/int/float only; None means 'not known' and is left out."""
    out: dict[str, Any] = {}
    for k, v in attributes.items():
        if v is None:
            continue
        out[k] = v if isinstance(v, (str, bool, int, float)) else str(v)
    return out
