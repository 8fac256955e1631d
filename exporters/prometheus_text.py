"""Prometheus text exposition (format 0.0.4) of the routing weights: ``GET /metrics`` of the feed."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from triscope.analyzers.routing import DOWN, DRAIN, READY, BackendWeight, WeightsResult
from triscope.analyzers.routing.model import LEVELS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

SCALE_ACTIONS = ("up", "down", "hold")


def escape_label(value: str) -> str:
    """Escape a label value: backslash, double quote and newline."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value; NaN and infinities use Prometheus' spellings."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


class MetricWriter:
    """Collects metric families and renders them with one HELP/TYPE header each."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str,
               samples: Iterable[tuple[Mapping[str, str], float]]) -> None:
        """Add a family; ``samples`` are (labels, value) pairs (NaN samples are skipped)."""
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            if isinstance(value, float) and math.isnan(value):
                continue
            if labels:
                inner = ",".join(f'{k}="{escape_label(str(v))}"' for k, v in labels.items())
                self._lines.append(f"{name}{{{inner}}} {format_value(value)}")
            else:
                self._lines.append(f"{name} {format_value(value)}")

    def render(self) -> bytes:
        return ("\n".join(self._lines) + "\n").encode()


def render_weights(result: WeightsResult | None, updates_total: int, update_errors_total: int,
                   last_update: float, inputs_age: float, unknown_seen: int = 0) -> bytes:
    """The feed's ``/metrics`` document for the latest ``result`` (None before the first update)."""
    w = MetricWriter()
    backends = sorted(result.backends.items()) if result is not None else []

    def per_backend(fn: Callable[[BackendWeight], float]) -> list[tuple[dict[str, str], float]]:
        return [({"backend": n}, float(fn(b))) for n, b in backends]

    w.family("triscope_backend_weight", "gauge", "Routing weight of the backend (0..1, 0 = drained).",
             per_backend(lambda b: b.weight))
    w.family("triscope_backend_target_weight", "gauge", "Undamped target weight of the backend (0..1).",
             per_backend(lambda b: b.target))
    w.family("triscope_backend_lb_weight", "gauge", "Integer weight published to load balancers.",
             per_backend(lambda b: b.lb_weight))
    w.family("triscope_backend_drained", "gauge", "1 when the backend is drained, else 0.",
             per_backend(lambda b: 1.0 if b.state == DRAIN else 0.0))
    w.family("triscope_backend_draining", "gauge", "Same as triscope_backend_drained (name of the first contract).",
             per_backend(lambda b: 1.0 if b.state == DRAIN else 0.0))
    w.family("triscope_backend_down", "gauge",
             "1 when the backend does not answer (scrape refused or failing, requests failing, spans stopped): "
             "no traffic until it answers.", per_backend(lambda b: 1.0 if b.state == DOWN else 0.0))
    w.family("triscope_backend_stale", "gauge", "1 when the backend's inputs are older than stale_after_s.",
             per_backend(lambda b: 1.0 if result is not None and b.backend in result.stale_backends else 0.0))
    w.family("triscope_backend_missing_factors", "gauge",
             "Factors the backend does not report, each set to the fleet's median penalty.",
             per_backend(lambda b: float(len(b.missing))))
    w.family("triscope_backend_weight_factor", "gauge", "Penalty factor (>= 1) of the weight formula.",
             [({"backend": n, "factor": f}, float(v)) for n, b in backends for f, v in sorted(b.factors.items())])
    # the engine's inputs under the feed's own prefix: the run's exporter owns the triscope_backend_* telemetry
    w.family("triscope_weights_input_memory_used_ratio", "gauge",
             "Engine input: GPU memory used/total (worst GPU of the backend).",
             per_backend(lambda b: b.inputs.memory_used_ratio))
    w.family("triscope_weights_input_kv_cache_usage_ratio", "gauge",
             "Engine input: KV-cache usage ratio reported by the backend.",
             per_backend(lambda b: b.inputs.kv_cache_usage_ratio))
    w.family("triscope_weights_input_requests_per_second", "gauge",
             "Engine input: request rate of the backend over the window.", per_backend(lambda b: b.inputs.qps))
    w.family("triscope_backend_input_age_seconds", "gauge", "Age of the backend's newest inputs at the update.",
             per_backend(lambda b: b.age_seconds))
    w.family("triscope_weights_inputs_age_seconds", "gauge", "Age of the oldest backend input at the last update.",
             [({}, inputs_age)])
    stale = float(result.stale) if result is not None else 1.0
    w.family("triscope_weights_stale", "gauge", "1 when no backend has fresh inputs and equal weights are published.",
             [({}, stale)])
    w.family("triscope_weights_down_backends", "gauge", "Backends published down.",
             [({}, float(len(result.down_backends)) if result is not None else 0.0)])
    w.family("triscope_weights_unknown_backends", "gauge",
             "Backends seen only in request spans (not configured, no scrape, no GPU samples): not published.",
             [({}, float(len(result.unknown_backends)) if result is not None else 0.0)])
    w.family("triscope_weights_unknown_backends_seen_total", "counter",
             "Distinct names seen only in request spans since the feed started (at most 10,000 remembered).",
             [({}, float(unknown_seen))])
    w.family("triscope_weights_absent_backends", "gauge",
             "Known backends without inputs within lookback_s, still published (docs/weights.md).",
             [({}, float(len(result.absent_backends)) if result is not None else 0.0)])
    w.family("triscope_weights_version", "gauge", "Version of the published weights (increments on change).",
             [({}, float(result.version) if result is not None else 0.0)])
    w.family("triscope_weights_updates_total", "counter", "Engine updates completed.", [({}, float(updates_total))])
    w.family("triscope_weights_update_errors_total", "counter", "Engine updates that failed.",
             [({}, float(update_errors_total))])
    w.family("triscope_weights_last_update_timestamp_seconds", "gauge", "Epoch seconds of the last update.",
             [({}, last_update if last_update > 0 else math.nan)])
    classes = sorted(result.classes.items()) if result is not None else []
    w.family("triscope_request_class_priority_weight", "gauge",
             "Queue priority weight of a request class: weight * max(1, p99/sla)^alpha.",
             [({"request_class": c}, float(v["priority_weight"])) for c, v in classes])
    admission = sorted(result.class_admission.items()) if result is not None else []
    w.family("triscope_backend_class_admitted", "gauge",
             "1 when the backend admits the request class, 0 when drained or closed by the class's KV or batch limit.",
             [({"backend": b, "request_class": c}, 1.0 if st == READY else 0.0)
              for c, states in admission for b, st in sorted(states.items())])
    levels = sorted(result.class_levels.items()) if result is not None else []
    w.family("triscope_class_admission_level", "gauge",
             "Admission level of a request class: 0 normal, 1 degrade (shed a share), 2 limit (token bucket), "
             "3 break (fallback answer).",
             [({"request_class": c}, float(LEVELS.index(lv.level))) for c, lv in levels])
    w.family("triscope_class_shed_ratio", "gauge", "Share of a request class the gateway sheds (degrade).",
             [({"request_class": c}, lv.shed_ratio) for c, lv in levels])
    w.family("triscope_class_admit_ratio", "gauge",
             "Share of a limited request class's recent arrival rate the gateway admits (limit).",
             [({"request_class": c}, lv.admit_ratio) for c, lv in levels])
    w.family("triscope_fleet_pressure_ratio", "gauge",
             "Fleet pressure the admission levels follow (1 = full, above 1 past full: the most pressing of mean KV "
             "usage, waiting per running request over queue_full, worst P99/SLA over latency_full).",
             [({}, result.pressure if result is not None else math.nan)])
    action = result.scale.action if result is not None else ""
    w.family("triscope_kv_cache_scale_recommendation", "gauge", "1 for the current KV-cache scaling action.",
             [({"action": a}, 1.0 if a == action else 0.0) for a in SCALE_ACTIONS] if result is not None else [])
    w.family("triscope_fleet_kv_cache_usage_ratio", "gauge", "Mean KV-cache usage of the reporting backends.",
             [({}, result.scale.fleet_kv_cache_usage_ratio if result is not None else math.nan)])
    return w.render()
