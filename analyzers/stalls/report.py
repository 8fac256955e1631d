"""What the stall classifier reports: evidence, classified windows, the report with shares and breaches.

Windows of a unit without device data (a CPU-only trace rank, an IO-only host) get CPU-side actions
(:data:`CPU_ACTIONS`) and never breach a device class: only ``io`` and stragglers breach there.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from triscope.analyzers.stalls.config import HOST_IO_DEVICE, UNCLASSIFIED, StallsConfig

ACTIONS = {
    "comm": "Communication-bound: overlap collectives with compute (DDP/FSDP bucket sizes, async ops), check "
            "NVLink/IB topology and NCCL_ALGO/NCCL_PROTO, lower the tensor-parallel degree, and fix the "
            "straggler rank first - the others are waiting for it.",
    "compute": "Compute-bound with memory bandwidth to spare: use lower precision (bf16/fp8), fused or "
               "compiled kernels (torch.compile), or add GPUs / replicas for this model.",
    "io": "Storage-bound: cache weights and data on local NVMe or in RAM, prefetch (more DataLoader workers, "
          "pin_memory), spread reads over devices, and move other heavy readers off this host.",
    "host": "Launch/host-bound: the GPU waits for the CPU - capture CUDA graphs, torch.compile "
            "mode='reduce-overhead', batch more per launch, and move pre/post-processing off the serving thread.",
    "idle": "Idle: no work reached this GPU - check load-balancer weights and routing, or scale in.",
    UNCLASSIFIED: "No rule matched (e.g. busy but memory-bandwidth-bound): see the evidence values.",
}
CPU_ACTIONS = {
    "comm": "Communication-bound on the host (no device data: gloo/MPI collectives): overlap them with "
            "work, send fewer or larger messages, check the network, and fix the straggler rank first.",
    "compute": "CPU-bound (no device data in this trace): profile the hottest ops, use vectorised or "
               "compiled ops (torch.compile), tune intra-op threads (torch.set_num_threads), or batch more.",
    "io": ACTIONS["io"],
    "host": "Host-bound (no device data): move pre/post-processing off the busy thread.",
    "idle": "Idle (no device data): the traced process recorded little work - it waited on input, "
            "locks, sleep or other processes.",
    UNCLASSIFIED: "No rule matched (no device data: CPU-side measures only): see the evidence values.",
}
_DEVICE_NAMES = {"gpu": "GPU", "mtia": "MTIA"}


def _device_kind(device: str) -> str:
    """``gpu`` of ``gpu0``, ``mtia`` of ``mtia17``."""
    return device.rstrip("0123456789").split("-")[0] or "gpu"


@dataclass
class Evidence:
    """One measured signal compared with its threshold."""

    metric: str
    value: float
    threshold: float
    op: str  # ">", ">=" or "<"
    source: str
    met: bool

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": _finite(self.value), "threshold": self.threshold,
                "op": self.op, "source": self.source, "met": self.met}

    def text(self) -> str:
        return f"{self.metric} {_fmt(self.value, self.metric)} {self.op} {_fmt(self.threshold, self.metric)}"


def _finite(x: Any) -> Any:
    if isinstance(x, str):
        return x
    return float(x) if x is not None and math.isfinite(x) else None


def _fmt(x: float | None, metric: str) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    if metric.endswith("_seconds"):
        return f"{x * 1e6:.0f}us" if x < 0.1 else f"{x:.3f}s"
    if metric.endswith(("_ratio", "_share")):
        return f"{x * 100:.1f}%"
    return f"{x:g}"


@dataclass
class Window:
    """One classified interval of one unit."""

    unit: str
    host: str
    device: str
    start_ns: int
    end_ns: int
    kind: str  # window or step
    label: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    verdict: str = UNCLASSIFIED
    matched: list[str] = field(default_factory=list)
    evidence: Mapping[str, list[Evidence]] = field(default_factory=dict)
    severity: float = 0.0
    device_data: bool = True
    """False for a unit with no device data (see the module docstring)."""

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def to_json(self) -> dict[str, Any]:
        return {
            "unit": self.unit, "host": self.host, "device": self.device, "device_data": self.device_data,
            "kind": self.kind, "label": self.label,
            "start_ns": self.start_ns, "end_ns": self.end_ns, "verdict": self.verdict, "also": self.matched[1:],
            "severity": round(self.severity, 4),
            "evidence": [e.to_json() for e in self.evidence.get(self.verdict, [])],
            "all_evidence": {c: [e.to_json() for e in ev] for c, ev in self.evidence.items()},
            "metrics": {k: _finite(v) for k, v in self.metrics.items()},
        }


@dataclass
class StallReport:
    """Classified windows of a time range plus shares, top windows and cross-rank evidence."""

    start_ns: int
    end_ns: int
    window_ms: float
    by: str
    config: StallsConfig
    windows: list[Window] = field(default_factory=list)
    stragglers: dict[str, Any] = field(default_factory=dict)
    flight_recorder: list[dict[str, Any]] = field(default_factory=list)

    _by_unit: dict[str, list[Window]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _indexed: int = field(default=-1, init=False, repr=False, compare=False)

    def _groups(self) -> dict[str, list[Window]]:
        """The windows by unit, grouped again only when windows were added: a fleet's hour holds hundreds
        of thousands, and every per-unit figure would otherwise scan them all."""
        if self._indexed != len(self.windows):
            self._by_unit = defaultdict(list)
            for w in self.windows:
                self._by_unit[w.unit].append(w)
            self._indexed = len(self.windows)
        return self._by_unit

    def unit_windows(self, unit: str | None = None) -> list[Window]:
        """The windows of ``unit`` (all of them for None)."""
        return self.windows if unit is None else self._groups().get(unit, [])

    def shares(self, unit: str | None = None) -> dict[str, float]:
        """Time share of each verdict (windows weighted by their length), largest first."""
        return _shares(self.unit_windows(unit))

    @property
    def device_data(self) -> bool:
        """Whether any window has device data (GPU samples or device work in a trace)."""
        return any(w.device_data for w in self.windows)

    @property
    def host_io_unclassified(self) -> bool:
        """Whether the range held only hosts' block-IO data (no GPU samples, no trace) and no rule read any of
        its windows as bound: a serving fleet without GPU telemetry, with nothing to report."""
        return bool(self.windows) and all(w.device == HOST_IO_DEVICE for w in self.windows) \
            and set(self.shares()) == {UNCLASSIFIED}

    def action(self, cls: str) -> str:
        """What to do about ``cls``: CPU-side when none of its windows has device data, else named for the
        devices that had it (GPU, MTIA)."""
        windows = [w for w in self.windows if w.verdict == cls]
        devices = {w.device for w in windows if w.device_data}
        if windows and not devices:
            return CPU_ACTIONS[cls]
        kinds = sorted({_DEVICE_NAMES.get(_device_kind(d), _device_kind(d).upper()) for d in devices})
        name = "/".join(kinds) or "GPU"
        return ACTIONS[cls] if name == "GPU" else ACTIONS[cls].replace("GPU", name)

    def units(self) -> list[str]:
        return sorted(self._groups())

    def top(self, n: int | None = None) -> list[Window]:
        """The worst windows of alert classes, by severity (how far past the threshold)."""
        n = self.config.top_windows if n is None else n
        alert = set(self.config.alert_classes)
        bad = [w for w in self.windows if w.verdict in alert]
        return sorted(bad, key=lambda w: (-w.severity, w.start_ns))[:n]

    def breaches(self) -> list[str]:
        """Why the command should exit non-zero (empty when nothing breached)."""
        out = []
        limit = self.config.alert_share
        # Device classes breach on device data only; io on any unit (an IO-only host has no device).
        alertable = (w for w in self.windows if w.device_data or w.verdict == "io")
        for cls, share in _shares(alertable).items():
            if cls in self.config.alert_classes and share > limit:
                out.append(f"{cls} {share * 100:.1f}% of the time > alert_share {limit * 100:g}%")
        for r in self.stragglers.get("by_rank", []):
            if r["max_lateness_seconds"] < self.config.straggler_alert_seconds:
                continue
            out.append(f"straggler rank {r['rank']} of run {r['run_id']}: last in {r['times_last']} of "
                       f"{r['collectives']} collectives, {r['total_lateness_seconds']:.3f}s total lateness")
        for fr in self.flight_recorder:
            if not fr["ok"]:
                out.append(f"flight recorder {fr['run_id']} pg {fr['comm_id']}: {len(fr['pending'])} pending, "
                           f"{len(fr['ranks_behind'])} rank(s) behind, {len(fr['mismatches'])} mismatch(es)")
        return out

    def share_text(self, unit: str | None = None) -> str:
        """``io 41%, comm 31%, compute 28%``; prefixed ``CPU only (no device data):`` when no window in scope
        has device data."""
        windows = self.unit_windows(unit)
        text = ", ".join(f"{k} {v * 100:.0f}%" for k, v in self.shares(unit).items())
        if windows and not any(w.device_data for w in windows) and any(w.device.startswith("cpu") for w in windows):
            return f"CPU only (no device data): {text}"
        return text

    def to_json(self, all_windows: bool = False) -> dict[str, Any]:
        shares = self.shares()
        thresholds = {k: v for k, v in self.config.as_dict().items() if k not in ("top_windows", "max_trace_events")}
        return {
            "range": {"start_ns": self.start_ns, "end_ns": self.end_ns}, "window_ms": self.window_ms, "by": self.by,
            "thresholds": thresholds,
            "shares": shares, "summary": self.share_text(), "device_data": self.device_data,
            "units": [{"unit": u, "windows": len(self.unit_windows(u)),
                       "device_data": any(w.device_data for w in self.unit_windows(u)),
                       "shares": self.shares(u)} for u in self.units()],
            "top_windows": [w.to_json() for w in self.top()],
            "actions": {c: self.action(c) for c in shares},
            "stragglers": self.stragglers, "flight_recorder": self.flight_recorder,
            "breaches": self.breaches(),
            **({"windows": [w.to_json() for w in self.windows]} if all_windows else {}),
        }


def _shares(windows: Iterable[Window]) -> dict[str, float]:
    """Time share of each verdict over ``windows`` (weighted by their length), largest first."""
    total: dict[str, float] = defaultdict(float)
    for w in windows:
        total[w.verdict] += w.seconds
    s = sum(total.values())
    return {k: v / s for k, v in sorted(total.items(), key=lambda kv: kv[1], reverse=True)} if s else {}
