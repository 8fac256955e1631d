"""The NVML sampler: GPU lifecycle and states, one ``gpu_samples`` row per GPU and sample, process memory."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from triscope.collectors.nvml.config import NvmlConfig
from triscope.collectors.nvml.device import ERR_GPU_IS_LOST, LOST_ERRORS, NAN, Device, ErrorClass, Lost, code, text
from triscope.schema import GPU_PROCESS_MEMORY, GPU_SAMPLES, Table, encode_ts
from triscope.tick_clock import TickClock

log = logging.getLogger(__name__)

_UNMEASURED = {c.name: NAN for c in GPU_SAMPLES.columns if c.type.startswith("Float")}
"""Row defaults: a metric the sample did not measure is NaN, not 0."""


class NvmlSampler:
    """Collector sampling every GPU through NVML (``[nvml]``, :class:`NvmlConfig`; failure states:
    docs/gpu-collectors.md). ``nvml`` injects the module (tests); by default ``import pynvml``."""

    name = "nvml"

    def __init__(self, config: Mapping[str, Any] | NvmlConfig | None = None, nvml: ModuleType | None = None) -> None:
        cfg = config if isinstance(config, NvmlConfig) else NvmlConfig.from_config(config)
        self.interval_s = cfg.interval_s
        self._clock = TickClock(cfg.interval_s)  # stamps on the tick grid: they compress to ~nothing
        self.host = cfg.host or socket.gethostname()
        self.only = list(cfg.devices)
        self.process_interval_s = cfg.process_interval_s
        self.use_gpm = cfg.gpm
        self.retry_s = cfg.retry_s
        self.ecc = cfg.ecc
        self._nv = nvml
        self._no_module = False
        self._error_cls: ErrorClass = Exception
        self.devices: list[Device] = []
        self.state = "stopped"
        self.reason = ""
        self._initialized = False
        self._retry_at = 0.0
        self._next_procs = 0.0
        self._names: dict[int, str] = {}
        self.samples = 0

    # -- state -----------------------------------------------------------------------------------
    def _set_state(self, state: str, reason: str = "") -> None:
        if state == self.state and reason == self.reason:
            return
        self.state, self.reason = state, reason
        if state == "ok":
            log.info("nvml: sampling %d GPU(s) every %.3g s", len(self.devices), self.interval_s)
        elif state == "degraded":
            log.warning("nvml: %s; other GPUs keep sampling", reason)
        else:
            log.warning("nvml: %s: %s; no GPU samples until it recovers", state, reason)

    def _refresh_state(self) -> None:
        lost = [d.index for d in self.devices if d.lost]
        if lost:
            self._set_state("degraded", f"GPU {', '.join(map(str, lost))} lost (NVML_ERROR_GPU_IS_LOST)")
        else:
            self._set_state("ok")

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Load NVML and enumerate GPUs; never raises (see :attr:`state`, :attr:`reason`)."""
        self._retry_at = time.monotonic() + self.retry_s
        if self._nv is None:
            try:
                import pynvml  # nvidia-ml-py's official module name
            except ImportError as exc:
                self._no_module = True
                self._set_state("unavailable", f"nvidia-ml-py is not installed ({exc})")
                return
            self._nv = pynvml
        nv = self._nv
        self._error_cls = getattr(nv, "NVMLError", Exception)
        if not self._initialized:
            try:
                nv.nvmlInit()
            except (self._error_cls, OSError) as exc:
                self._set_state("unavailable", f"nvmlInit failed: {exc} (code {code(exc)})")
                return
            self._initialized = True
        try:
            count = nv.nvmlDeviceGetCount()
        except self._error_cls as exc:
            self._set_state("unavailable", f"nvmlDeviceGetCount failed: {exc} (code {code(exc)})")
            return
        self.devices = [d for i in range(count) if not self.only or i in self.only
                        if (d := self._open(nv, i)) is not None]
        if not self.devices:
            self._set_state("no_gpu", "NVML sees no GPU" if count == 0 else
                            f"none of the configured devices {self.only} exist (count {count})")
            return
        self._refresh_state()

    def _open(self, nv: ModuleType, index: int) -> Device | None:
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except self._error_cls as exc:
            if code(exc) in LOST_ERRORS:
                dev = Device(nv, self._error_cls, index, None, "", "")
                dev.lost, dev.lost_code = True, code(exc)
                dev.retry_at = time.monotonic() + self.retry_s
                return dev
            log.warning("nvml: GPU %d skipped: nvmlDeviceGetHandleByIndex: %s", index, exc)
            return None
        dev = Device(nv, self._error_cls, index, handle, text(lambda: nv.nvmlDeviceGetUUID(handle), self._error_cls),
                     text(lambda: nv.nvmlDeviceGetName(handle), self._error_cls))
        dev.prepare(self.ecc, self.use_gpm)
        return dev

    def close(self) -> None:
        """Free GPM samples and shut NVML down; safe to call twice."""
        for dev in self.devices:
            dev.free()
        self.devices = []
        if self._initialized and self._nv is not None:
            self._initialized = False
            with contextlib.suppress(self._error_cls):
                self._nv.nvmlShutdown()
        self.state = "stopped"

    # -- sampling --------------------------------------------------------------------------------
    def _lost_row(self, ts: str, dev: Device) -> dict[str, Any]:
        return {"ts": ts, "host": self.host, "gpu": dev.index, "gpu_uuid": dev.uuid, "gpu_model": dev.model,
                "source": "nvml", "clock_event_reasons": 0, "state": "lost", "error": dev.lost_text}

    def _sample_device(self, dev: Device, procs: list[dict[str, Any]] | None, ts: str, now_us: int) -> dict[str, Any]:
        """One ``gpu_samples`` row of ``dev`` (and its processes into ``procs``); Lost."""
        mem = dev.call("memory")
        util = dev.call("util")
        sm_clock = dev.call("sm_clock")
        temp = dev.call("temp")
        reasons = dev.call("reasons")
        f = dev.read_fields(now_us)
        power_mw = f.get("power_mw")
        if power_mw is None:
            power_mw = dev.call("power")
        sm_active, sm_occupancy, dram_active = dev.read_gpm()
        row = {"ts": ts, "host": self.host, "gpu": dev.index, "gpu_uuid": dev.uuid, "gpu_model": dev.model,
               "source": "nvml", "state": "ok", "sm_active_ratio": sm_active, "sm_occupancy_ratio": sm_occupancy,
               "dram_active_ratio": dram_active,
               # chDB casts ints < 2**63 only
               "clock_event_reasons": int(reasons) & 0x7FFF_FFFF_FFFF_FFFF if reasons is not None else 0,
               "pcie_tx_bytes_per_second": f.get("pcie_tx", NAN), "pcie_rx_bytes_per_second": f.get("pcie_rx", NAN),
               "nvlink_tx_bytes_per_second": f.get("nvlink_tx", NAN),
               "nvlink_rx_bytes_per_second": f.get("nvlink_rx", NAN),
               "ecc_corrected_total": f.get("ecc_corrected", NAN),
               "ecc_uncorrected_total": f.get("ecc_uncorrected", NAN)}
        if mem is not None:
            row["memory_used_bytes"], row["memory_total_bytes"] = float(mem.used), float(mem.total)
            row["memory_reserved_bytes"] = float(mem.reserved) if hasattr(mem, "reserved") else NAN
        if util is not None:
            row["gpu_util_ratio"], row["memory_util_ratio"] = util.gpu / 100.0, util.memory / 100.0
        if sm_clock is not None:
            row["sm_clock_hz"] = sm_clock * 1e6
        if power_mw is not None:
            row["power_watts"] = power_mw / 1000.0
        if temp is not None:
            row["temperature_celsius"] = float(temp)
        if procs is not None:
            for p in dev.call("procs") or ():
                used = p.usedGpuMemory
                procs.append({"ts": ts, "host": self.host, "gpu": dev.index, "pid": int(p.pid),
                              "process_name": self._name(int(p.pid)),
                              "used_bytes": float(used) if used is not None else NAN})
        return row

    def _name(self, pid: int) -> str:
        name = self._names.get(pid)
        if name is None:
            if len(self._names) > 4096:
                self._names.clear()
            nv = self._nv
            assert nv is not None
            name = text(lambda: nv.nvmlSystemGetProcessName(pid), self._error_cls)
            self._names[pid] = name
        return name

    def _reprobe(self, i: int, now: float) -> bool:
        """Try a lost GPU again; True (and a fresh device in slot ``i``) when it answers."""
        dev = self.devices[i]
        dev.retry_at = now + self.retry_s
        nv = self._nv
        assert nv is not None
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(dev.index)
            nv.nvmlDeviceGetMemoryInfo(handle)
        except self._error_cls:
            return False
        dev.free()
        fresh = Device(nv, self._error_cls, dev.index, handle,
                       dev.uuid or text(lambda: nv.nvmlDeviceGetUUID(handle), self._error_cls),
                       dev.model or text(lambda: nv.nvmlDeviceGetName(handle), self._error_cls))
        fresh.prepare(self.ecc, self.use_gpm)
        self.devices[i] = fresh
        log.warning("nvml: GPU %d answers again", dev.index)
        return True

    def sample_once(self, now_ns: int | None = None) -> dict[Table, dict[str, list[Any]]]:
        """One sample of every GPU: ``{"gpu_samples": cols, "gpu_process_memory": cols}`` (no empty tables).

        Returns ``{}`` while NVML is unavailable or there is no GPU (init is retried every ``retry_s``)."""
        mono = time.monotonic()
        if not self.devices:
            if self.state == "unavailable" and not self._no_module and mono >= self._retry_at:
                self.start()
            if not self.devices:
                return {}
        now_ns = self._clock.now_ns() if now_ns is None else now_ns
        ts = encode_ts(now_ns)
        rows: list[dict[str, Any]] = []
        procs: list[dict[str, Any]] | None = None
        if self.process_interval_s >= 0 and mono >= self._next_procs:
            procs = []
            self._next_procs = mono + self.process_interval_s
        changed = False
        for i in range(len(self.devices)):
            dev = self.devices[i]
            if dev.lost:
                if mono < dev.retry_at or not self._reprobe(i, mono):
                    rows.append(self._lost_row(ts, dev))
                    continue
                dev = self.devices[i]
                changed = True
            try:
                rows.append(self._sample_device(dev, procs, ts, now_ns // 1000))
            except Lost as exc:  # raised before any of the GPU's process rows were added
                dev.lost_code = int(exc.args[0]) if exc.args else ERR_GPU_IS_LOST
                dev.lost = True
                dev.retry_at = mono + self.retry_s
                dev.prev.clear()
                rows.append(self._lost_row(ts, dev))
                changed = True
        if changed:
            self._refresh_state()
        self.samples += 1
        out = {GPU_SAMPLES: GPU_SAMPLES.columns_of(rows, defaults=_UNMEASURED)}
        if procs:
            out[GPU_PROCESS_MEMORY] = GPU_PROCESS_MEMORY.columns_of(procs)
        return out

    def collect(self) -> dict[Table, dict[str, list[Any]]]:
        """Collector protocol: one sample (see :meth:`sample_once`)."""
        return self.sample_once()
