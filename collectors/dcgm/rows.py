"""Fold the samples of one dcgm-exporter exposition into ``gpu_samples`` rows.

One row per (host, GPU, MIG instance): a whole GPU has ``mig_instance = ''``; a MIG instance
(``GPU_I_ID`` / ``GPU_I_PROFILE`` labels) keeps the parent's ``gpu`` index and UUID. Which labels
name the host and the workload depends on how the text reached us (docs/gpu-collectors.md):

* workload: ``exported_pod`` / ``exported_namespace`` / ``exported_container`` first (a Prometheus
  scrape without ``honor_labels`` renames dcgm-exporter's own labels so); then dcgm-exporter's
  ``--use-old-namespace`` names ``pod_name`` / ``pod_namespace`` / ``container_name``; then
  ``pod`` / ``namespace`` / ``container``, unless that pod is the exporter itself.
* host: the target's ``host`` override, its ``host_label``, ``Hostname`` / ``hostname``, the host
  part of Prometheus' ``instance`` label, then the target URL's host.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from triscope.collectors.dcgm.parse import FIELDS, Parsed, is_blank, parse_exposition
from triscope.errors import InputError
from triscope.schema import GPU_SAMPLES, encode_ts

NAN = math.nan
NO_GPU = 65535
"""``gpu`` of a target-level state row (a target that failed before any GPU was seen there)."""

_EMPTY_ROW: dict[str, Any] = {**GPU_SAMPLES.defaults(),
                               **{c.name: NAN for c in GPU_SAMPLES.columns if c.type.startswith("Float")}}
"""A row before a scrape fills it: a metric not seen is NaN, not 0."""

_EXPORTED = ("exported_pod", "exported_namespace", "exported_container")
_OLD = ("pod_name", "pod_namespace", "container_name")
_PLAIN = ("pod", "namespace", "container")


@dataclass(frozen=True)
class Identity:
    """How one target's labels name hosts and workloads."""

    default_host: str = ""
    """The target URL's host: used when no label names one."""
    host: str = ""
    """Override for every series of the target (an exporter whose Hostname label is its pod name)."""
    host_label: str = ""
    """A label naming the host (e.g. ``node`` added by relabelling), tried before ``Hostname``."""
    exporter_pods: Sequence[str] = ("*dcgm-exporter*",)
    """Globs of the exporter's own pod names: such a ``pod`` label is not a workload."""


@dataclass
class Gpu:
    """One GPU (or MIG instance) of one host while a scrape is folded."""

    host: str
    index: int
    uuid: str = ""
    model: str = ""
    mig_instance: str = ""
    mig_profile: str = ""
    pods: dict[tuple[str, str, str], None] = field(default_factory=dict)  # ordered set
    values: dict[str, tuple[int, float]] = field(default_factory=dict)     # column -> (rank, value)
    stamp_ms: int | None = None

    @property
    def key(self) -> tuple[str, int, str]:
        return self.host, self.index, self.mig_instance


def _sort_key(key: tuple[str, int, str]) -> tuple[str, int, int, str]:
    host, index, inst = key
    return host, index, int(inst) if inst.isdigit() else -1, inst


def _host(labels: dict[str, str], ident: Identity) -> str:
    if ident.host:
        return ident.host
    if ident.host_label and labels.get(ident.host_label):
        return labels[ident.host_label]
    named = labels.get("Hostname") or labels.get("hostname")
    if named:
        return named
    instance = labels.get("instance", "")
    if instance:  # through Prometheus: the exporter's address, "10.0.3.7:9400" or "[fd00::7]:9400"
        if instance.startswith("["):
            return instance[1:].partition("]")[0]
        host, sep, port = instance.rpartition(":")
        return host if sep and port.isdigit() else instance
    return ident.default_host


def _scrape_target(labels: dict[str, str]) -> tuple[str, str] | None:
    """(job, instance) of a series that came through Prometheus (dcgm-exporter writes neither)."""
    return (labels.get("job", ""), labels["instance"]) if "instance" in labels else None


def _unhonored(parsed: Parsed) -> set[tuple[str, str] | None]:
    """Prometheus scrape targets whose dcgm labels were renamed ``exported_*`` (no ``honor_labels``):
    there, every plain ``pod`` label is the exporter's own (a Prometheus target label)."""
    out = {_scrape_target(lab) for _, lab, _ in parsed.samples if any(lab.get(k) for k in _EXPORTED)}
    out.discard(None)
    return out


def _workload(labels: dict[str, str], unhonored: set[tuple[str, str] | None],
              ident: Identity) -> tuple[str, str, str]:
    for names in (_EXPORTED, _OLD):
        if labels.get(names[0]):
            return labels[names[0]], labels.get(names[1], ""), labels.get(names[2], "")
    pod = labels.get("pod", "")
    if not pod or _scrape_target(labels) in unhonored:
        return "", "", ""
    if any(fnmatch.fnmatchcase(pod, glob) for glob in ident.exporter_pods):
        return "", "", ""
    return pod, labels.get("namespace", ""), labels.get("container", "")


def fold(parsed: Parsed, ident: Identity | str) -> list[Gpu]:
    """One entry per (host, GPU index, MIG instance) with the best-ranked value of each column."""
    if isinstance(ident, str):
        ident = Identity(default_host=ident)
    unhonored = _unhonored(parsed)
    gpus: dict[tuple[str, int, str], Gpu] = {}
    for (name, labels, raw), stamp in zip(parsed.samples, parsed.stamps_ms, strict=True):
        try:
            index = int(labels.get("gpu", ""))
        except ValueError:
            continue  # not a GPU entity (NVSwitch, CPU, ...)
        if not 0 <= index < NO_GPU:
            continue
        key = (_host(labels, ident), index, labels.get("GPU_I_ID", ""))
        g = gpus.get(key)
        if g is None:
            g = gpus[key] = Gpu(key[0], index, mig_instance=key[2])
        g.uuid = g.uuid or labels.get("UUID") or labels.get("uuid", "")
        g.model = g.model or labels.get("modelName", "")
        g.mig_profile = g.mig_profile or labels.get("GPU_I_PROFILE", "")
        pod = _workload(labels, unhonored, ident)
        if pod[0]:
            g.pods[pod] = None
        if stamp is not None:
            g.stamp_ms = stamp if g.stamp_ms is None else max(g.stamp_ms, stamp)
        spec = FIELDS[name]
        value = NAN if is_blank(raw, spec.small) else raw * spec.scale / spec.div
        have = g.values.get(spec.column)  # keep the finite value of the lowest rank (first one on a tie)
        if have is None or (math.isfinite(value) and (not math.isfinite(have[1]) or spec.rank < have[0])):
            g.values[spec.column] = (spec.rank, value)
    return [gpus[k] for k in sorted(gpus, key=_sort_key)]


def state_row(ts: str, g: Gpu, state: str, error: str) -> dict[str, Any]:
    """The ``gpu_samples`` row of ``g`` (NaN where nothing was measured)."""
    v = {c: val for c, (_, val) in g.values.items()}
    used, free, reserved = (v.get(k, NAN) for k in ("memory_used_bytes", "_fb_free_bytes", "memory_reserved_bytes"))
    total = v.get("memory_total_bytes", NAN)
    if not math.isfinite(total) and math.isfinite(used) and math.isfinite(free):
        total = used + free + (reserved if math.isfinite(reserved) else 0.0)
    reasons = v.get("clock_event_reasons", NAN)
    pods = list(g.pods)
    row = dict(_EMPTY_ROW)
    row.update(v)
    row.pop("_fb_free_bytes", None)
    row.update({
        "ts": ts, "host": g.host, "gpu": g.index, "gpu_uuid": g.uuid, "gpu_model": g.model, "source": "dcgm",
        "mig_instance": g.mig_instance, "mig_profile": g.mig_profile,
        "memory_total_bytes": total,
        "clock_event_reasons": int(reasons) & 0x7FFF_FFFF_FFFF_FFFF if math.isfinite(reasons) else 0,
        "state": state, "error": error,
        "pod": ",".join(dict.fromkeys(p for p, _, _ in pods)),
        "namespace": ",".join(dict.fromkeys(n for _, n, _ in pods if n)),
        "container": ",".join(dict.fromkeys(c for _, _, c in pods if c)),
    })
    return row


def _no_rows_error(parsed: Parsed, source: str) -> InputError:
    if parsed.samples:
        return InputError(f"{source}: no DCGM_FI_* GPU series in the response (the mapped series carry no gpu label)")
    if parsed.unmapped:
        names = sorted(parsed.unmapped, key=lambda n: (-parsed.unmapped[n], n))
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return InputError(f"{source}: no mapped fields: {sum(parsed.unmapped.values())} DCGM_FI_* samples ({shown}) "
                          "but none triscope maps; export e.g. DCGM_FI_DEV_FB_USED, DCGM_FI_DEV_GPU_UTIL")
    if parsed.bad_lines:
        return InputError(f"{source}: not Prometheus text ({parsed.bad_lines} bad lines; first {parsed.first_bad})")
    return InputError(f"{source}: no DCGM_FI_* GPU series in the response")


def rows_from_gpus(gpus: list[Gpu], ts_ns: int, warning: str) -> list[dict[str, Any]]:
    """``ok`` rows; a GPU whose samples carried timestamps (federation) is stamped with the newest one."""
    now = encode_ts(ts_ns)
    return [state_row(now if g.stamp_ms is None else encode_ts(g.stamp_ms * 1_000_000), g, "ok", warning)
            for g in gpus]


def parse_gpus(text: str, ident: Identity | str, source: str = "metrics") -> tuple[list[Gpu], str]:
    """(GPUs, warning) of one exposition; InputError (one line) when it yields no GPU."""
    parsed = parse_exposition(text)
    gpus = fold(parsed, ident)
    if not gpus:
        raise _no_rows_error(parsed, source)
    warning = ""
    if parsed.bad_lines:
        warning = f"{source}: skipped {parsed.bad_lines} malformed lines (first {parsed.first_bad})"
    return gpus, warning


def rows_from_text(text: str, default_host: str | Identity, ts_ns: int,
                   source: str = "metrics") -> tuple[list[dict[str, Any]], str]:
    """(rows, warning) of one exposition; InputError (one line) when it holds no DCGM GPU series."""
    gpus, warning = parse_gpus(text, default_host, source)
    return rows_from_gpus(gpus, ts_ns, warning), warning


__all__ = ["NO_GPU", "Gpu", "Identity", "fold", "parse_gpus", "rows_from_gpus", "rows_from_text", "state_row"]
