"""NVML sampler for ``gpu_samples`` and ``gpu_process_memory`` (nvidia-ml-py, module ``pynvml``).

Per GPU and sample: memory used/total/reserved (``nvmlDeviceGetMemoryInfo`` with ``nvmlMemory_v2``,
v1 without reserved on old drivers), GPU/memory utilization, SM clock, temperature, clock-event
(throttle) reasons and, in **one** ``nvmlDeviceGetFieldValues`` call, instant power, PCIe TX/RX
byte counters, NVLink data TX/RX counters (all links, ``scopeId = UINT_MAX``) and ECC totals.
Counters become rates from the change between two samples over the NVML field timestamps.
GPM (Hopper+) gives SM activity, SM occupancy and DRAM bandwidth utilization from two GPM
samples. Running processes (compute) are read every ``process_interval_s``.

Failure states never raise out of :meth:`NvmlSampler.collect`:

* module missing / library or driver absent / init failure -> collector ``state = "unavailable"``
  (init retried every ``retry_s``), no rows;
* zero GPUs -> ``state = "no_gpu"``, no rows;
* ``NVML_ERROR_GPU_IS_LOST`` (or ``RESET_REQUIRED``) on a GPU -> that GPU's rows carry
  ``state = "lost"`` with NaN metrics, it is re-probed every ``retry_s``; the others keep sampling
  (collector ``state = "degraded"``);
* a metric a GPU does not support (``NOT_SUPPORTED``, ``NO_PERMISSION``, ``FUNCTION_NOT_FOUND``)
  is NaN and no longer queried; any other error makes it NaN for that sample only.

Each state change is one log line. Load from ``triscope run`` as ``triscope.collectors.nvml:factory``;
config section ``[nvml]``: interval_s, host, devices, process_interval_s, gpm, retry_s, ecc.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from triscope.schema import encode_ts
from triscope.schema.gpu import GPU_PROCESS_MEMORY, GPU_SAMPLES

log = logging.getLogger(__name__)

SAMPLES_TABLE = "gpu_samples"
PROCESS_TABLE = "gpu_process_memory"
SAMPLE_COLUMNS = GPU_SAMPLES.column_names()
PROCESS_COLUMNS = GPU_PROCESS_MEMORY.column_names()

DEFAULTS: dict[str, Any] = {
    "interval_s": 0.1,          # 100-200 ms recommended
    "host": "",                 # default: socket.gethostname()
    "devices": [],              # NVML indices to sample; empty = all
    "process_interval_s": 1.0,  # per-process memory; 0 = every sample, < 0 = never
    "gpm": True,                # GPM SM activity / occupancy / DRAM bandwidth where supported
    "retry_s": 30.0,            # re-init when unavailable, re-probe lost GPUs
    "ecc": "volatile",          # "volatile" (since driver load) or "aggregate" (lifetime)
}

# NVML return codes (nvml.h; same values as pynvml.NVML_ERROR_*).
ERR_INVALID_ARGUMENT = 2
ERR_NOT_SUPPORTED = 3
ERR_NO_PERMISSION = 4
ERR_FUNCTION_NOT_FOUND = 13
ERR_GPU_IS_LOST = 15
ERR_RESET_REQUIRED = 16
PERMANENT_ERRORS = frozenset({ERR_INVALID_ARGUMENT, ERR_NOT_SUPPORTED, ERR_NO_PERMISSION, ERR_FUNCTION_NOT_FOUND})
LOST_ERRORS = frozenset({ERR_GPU_IS_LOST, ERR_RESET_REQUIRED})

# Field ids (nvml.h NVML_FI_*), used when the installed nvidia-ml-py predates a name.
FI_ECC_SBE_VOL_TOTAL, FI_ECC_DBE_VOL_TOTAL, FI_ECC_SBE_AGG_TOTAL, FI_ECC_DBE_AGG_TOTAL = 3, 4, 5, 6
FI_NVLINK_THROUGHPUT_DATA_TX, FI_NVLINK_THROUGHPUT_DATA_RX = 138, 139  # KiB counters
FI_POWER_INSTANT = 186  # milliwatts
FI_PCIE_COUNT_TX_BYTES, FI_PCIE_COUNT_RX_BYTES = 197, 198  # byte counters
SCOPE_ALL_LINKS = 0xFFFFFFFF  # UINT_MAX: NVLink counters summed over all links
GPM_SM_UTIL, GPM_SM_OCCUPANCY, GPM_DRAM_BW_UTIL = 2, 3, 10  # percent 0..100

# c_nvmlValue_t member by NVML_VALUE_TYPE_* (0 double .. 6 unsigned short).
_VALUE_MEMBER = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
_WRAP = {1: 1 << 32, 6: 1 << 16}  # counters of these value types wrap; 64-bit ones effectively never

NAN = math.nan
LOST_TEXT = {15: "NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus", 16: "NVML_ERROR_RESET_REQUIRED: the GPU needs a reset"}


class _Lost(Exception):
    """The GPU answered GPU_IS_LOST / RESET_REQUIRED (``args[0]``: the NVML code)."""


def _code(exc: BaseException) -> int:
    return int(getattr(exc, "value", -1))


def _const(nv: ModuleType, name: str, default: int) -> int:
    return int(getattr(nv, name, default))


class _Device:
    """Per-GPU handle, prepared calls and counter baselines."""

    def __init__(self, index: int, handle: Any, uuid: str, model: str) -> None:
        self.index = index
        self.handle = handle
        self.uuid = uuid
        self.model = model
        self.lost = False
        self.lost_code = ERR_GPU_IS_LOST
        self.retry_at = 0.0
        # key -> list of (callable, args) alternatives; the first that works is kept.
        self.getters: dict[str, list[tuple[Callable[..., Any], tuple[Any, ...]]]] = {}
        self.fields: list[tuple[int, int]] = []   # (fieldId, scopeId) requested in one call
        self.field_keys: list[str] = []            # what each entry means
        self.prev: dict[str, tuple[int, int]] = {}  # counter key -> (value, timestamp us)
        self.gpm: _Gpm | None = None
        self.warned: set[tuple[str, int]] = set()


class _Gpm:
    """Two alternating GPM samples and one reusable metrics-get struct."""

    def __init__(self, nv: ModuleType, handle: Any) -> None:
        self.nv = nv
        self.handle = handle
        self.samples = [nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()]
        self.cur = 0
        self.primed = False
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = _const(nv, "NVML_GPM_METRICS_GET_VERSION", 1)
        ids = (_const(nv, "NVML_GPM_METRIC_SM_UTIL", GPM_SM_UTIL),
               _const(nv, "NVML_GPM_METRIC_SM_OCCUPANCY", GPM_SM_OCCUPANCY),
               _const(nv, "NVML_GPM_METRIC_DRAM_BW_UTIL", GPM_DRAM_BW_UTIL))
        mg.numMetrics = len(ids)
        for i, metric in enumerate(ids):
            mg.metrics[i].metricId = metric
        self.mg = mg

    def read(self) -> tuple[float, float, float]:
        """(sm_active, sm_occupancy, dram_active) ratios since the previous read; NaN on the first."""
        nv = self.nv
        cur = self.samples[self.cur]
        nv.nvmlGpmSampleGet(self.handle, cur)
        out = (NAN, NAN, NAN)
        if self.primed:
            mg = self.mg
            mg.sample1 = self.samples[1 - self.cur]
            mg.sample2 = cur
            nv.nvmlGpmMetricsGet(mg)
            m = mg.metrics
            out = tuple(m[i].value / 100.0 if m[i].nvmlReturn == 0 else NAN for i in range(3))  # type: ignore[assignment]
        self.primed = True
        self.cur = 1 - self.cur
        return out

    def free(self) -> None:
        for s in self.samples:
            with contextlib.suppress(Exception):  # best effort on shutdown
                self.nv.nvmlGpmSampleFree(s)


def _empty(columns: list[str]) -> dict[str, list[Any]]:
    return {c: [] for c in columns}


class NvmlSampler:
    """Collector sampling every GPU through NVML (``[nvml]`` config section).

    ``nvml`` injects the module (tests); by default ``import pynvml`` from nvidia-ml-py.
    """

    name = "nvml"

    def __init__(self, config: dict[str, Any] | None = None, nvml: ModuleType | None = None) -> None:
        cfg = {**DEFAULTS, **((config or {}).get("nvml", {}))}
        self.interval_s = float(cfg["interval_s"])
        self.host = str(cfg["host"]) or socket.gethostname()
        self.only = [int(i) for i in cfg["devices"]]
        self.process_interval_s = float(cfg["process_interval_s"])
        self.use_gpm = bool(cfg["gpm"])
        self.retry_s = float(cfg["retry_s"])
        ecc = str(cfg["ecc"])
        if ecc not in ("volatile", "aggregate"):
            from triscope.errors import ConfigError

            raise ConfigError(f"nvml: ecc must be 'volatile' or 'aggregate', not {ecc!r}")
        self.ecc = ecc
        self._nv = nvml
        self._no_module = False
        self._error_cls: type[BaseException] = Exception
        self.devices: list[_Device] = []
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
            except (self._error_cls, OSError) as exc:  # type: ignore[misc]
                self._set_state("unavailable", f"nvmlInit failed: {exc} (code {_code(exc)})")
                return
            self._initialized = True
        try:
            count = nv.nvmlDeviceGetCount()
        except self._error_cls as exc:  # type: ignore[misc]
            self._set_state("unavailable", f"nvmlDeviceGetCount failed: {exc} (code {_code(exc)})")
            return
        self.devices = [d for i in range(count) if not self.only or i in self.only
                        if (d := self._open(i)) is not None]
        if not self.devices:
            self._set_state("no_gpu", "NVML sees no GPU" if count == 0 else
                            f"none of the configured devices {self.only} exist (count {count})")
            return
        self._refresh_state()

    def _open(self, index: int) -> _Device | None:
        nv = self._nv
        assert nv is not None
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except self._error_cls as exc:  # type: ignore[misc]
            dev = _Device(index, None, "", "")
            if _code(exc) in LOST_ERRORS:
                dev.lost, dev.lost_code = True, _code(exc)
                dev.retry_at = time.monotonic() + self.retry_s
                return dev
            log.warning("nvml: GPU %d skipped: nvmlDeviceGetHandleByIndex: %s", index, exc)
            return None
        uuid = self._text(lambda: nv.nvmlDeviceGetUUID(handle))
        model = self._text(lambda: nv.nvmlDeviceGetName(handle))
        dev = _Device(index, handle, uuid, model)
        self._prepare(dev)
        return dev

    def _text(self, fn: Callable[[], Any]) -> str:
        try:
            value = fn()
        except self._error_cls:  # type: ignore[misc]
            return ""
        return value.decode() if isinstance(value, bytes) else str(value)

    def _prepare(self, dev: _Device) -> None:
        """Bind each metric's NVML call(s) once so a sample only calls them."""
        nv = self._nv
        assert nv is not None
        h = dev.handle
        g = dev.getters

        def alts(*pairs: tuple[str, tuple[Any, ...]]) -> list[tuple[Callable[..., Any], tuple[Any, ...]]]:
            return [(getattr(nv, fn), args) for fn, args in pairs if hasattr(nv, fn)]

        mem_v2 = getattr(nv, "nvmlMemory_v2", None)
        g["memory"] = alts(*((("nvmlDeviceGetMemoryInfo", (h, mem_v2)),) if mem_v2 else ()),
                           ("nvmlDeviceGetMemoryInfo", (h,)))
        g["util"] = alts(("nvmlDeviceGetUtilizationRates", (h,)))
        g["sm_clock"] = alts(("nvmlDeviceGetClockInfo", (h, _const(nv, "NVML_CLOCK_SM", 1))))
        sensor = _const(nv, "NVML_TEMPERATURE_GPU", 0)
        g["temp"] = alts(("nvmlDeviceGetTemperatureV", (h, sensor)), ("nvmlDeviceGetTemperature", (h, sensor)))
        g["reasons"] = alts(("nvmlDeviceGetCurrentClocksEventReasons", (h,)),
                            ("nvmlDeviceGetCurrentClocksThrottleReasons", (h,)))
        g["power"] = alts(("nvmlDeviceGetPowerUsage", (h,)))
        g["procs"] = alts(("nvmlDeviceGetComputeRunningProcesses", (h,)))
        sbe, dbe = (("NVML_FI_DEV_ECC_SBE_VOL_TOTAL", FI_ECC_SBE_VOL_TOTAL),
                    ("NVML_FI_DEV_ECC_DBE_VOL_TOTAL", FI_ECC_DBE_VOL_TOTAL))
        if self.ecc == "aggregate":
            sbe, dbe = (("NVML_FI_DEV_ECC_SBE_AGG_TOTAL", FI_ECC_SBE_AGG_TOTAL),
                        ("NVML_FI_DEV_ECC_DBE_AGG_TOTAL", FI_ECC_DBE_AGG_TOTAL))
        wanted = [
            ("power_mw", _const(nv, "NVML_FI_DEV_POWER_INSTANT", FI_POWER_INSTANT), 0),
            ("pcie_tx", _const(nv, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", FI_PCIE_COUNT_TX_BYTES), 0),
            ("pcie_rx", _const(nv, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", FI_PCIE_COUNT_RX_BYTES), 0),
            ("nvlink_tx", _const(nv, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", FI_NVLINK_THROUGHPUT_DATA_TX),
             SCOPE_ALL_LINKS),
            ("nvlink_rx", _const(nv, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", FI_NVLINK_THROUGHPUT_DATA_RX),
             SCOPE_ALL_LINKS),
            ("ecc_corrected", _const(nv, *sbe), 0),
            ("ecc_uncorrected", _const(nv, *dbe), 0),
        ]
        dev.field_keys = [k for k, _, _ in wanted]
        dev.fields = [(fid, scope) for _, fid, scope in wanted]
        if self.use_gpm and hasattr(nv, "nvmlGpmQueryDeviceSupport"):
            try:
                if nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice:
                    dev.gpm = _Gpm(nv, h)
            except self._error_cls as exc:  # type: ignore[misc]
                if _code(exc) not in PERMANENT_ERRORS:
                    log.info("nvml: GPU %d: GPM unavailable: %s", dev.index, exc)

    def close(self) -> None:
        """Free GPM samples and shut NVML down; safe to call twice."""
        for dev in self.devices:
            if dev.gpm is not None:
                dev.gpm.free()
                dev.gpm = None
        self.devices = []
        if self._initialized and self._nv is not None:
            self._initialized = False
            with contextlib.suppress(self._error_cls):
                self._nv.nvmlShutdown()
        self.state = "stopped"

    # -- sampling --------------------------------------------------------------------------------
    def _call(self, dev: _Device, key: str) -> Any:
        """Value of a prepared metric, or None (unsupported, or a transient error this sample)."""
        options = dev.getters.get(key)
        while options:
            fn, args = options[0]
            try:
                return fn(*args)
            except self._error_cls as exc:  # type: ignore[misc]
                code = _code(exc)
                if code in LOST_ERRORS:
                    raise _Lost(code) from None
                if code in PERMANENT_ERRORS:
                    options.pop(0)
                    if not options:
                        log.info("nvml: GPU %d: %s not available (%s)", dev.index, key, exc)
                    continue
                if (key, code) not in dev.warned:
                    dev.warned.add((key, code))
                    log.warning("nvml: GPU %d: %s failed: %s (code %d); NaN for now", dev.index, key, exc, code)
                return None
        return None

    def _fields(self, dev: _Device, now_us: int) -> dict[str, float]:
        """One nvmlDeviceGetFieldValues call: instantaneous values and counter rates."""
        out: dict[str, float] = {}
        if not dev.fields:
            return out
        try:
            values = self._nv.nvmlDeviceGetFieldValues(dev.handle, dev.fields)  # type: ignore[union-attr]
        except self._error_cls as exc:  # type: ignore[misc]
            code = _code(exc)
            if code in LOST_ERRORS:
                raise _Lost(code) from None
            if code in PERMANENT_ERRORS:
                log.info("nvml: GPU %d: field values not available (%s)", dev.index, exc)
                dev.fields, dev.field_keys = [], []
            return out
        drop: list[int] = []
        for i, key in enumerate(dev.field_keys):
            fv = values[i]
            ret = fv.nvmlReturn
            if ret != 0:
                if ret in LOST_ERRORS:
                    raise _Lost(ret)
                if ret in PERMANENT_ERRORS:
                    drop.append(i)
                continue
            vtype = fv.valueType
            raw = getattr(fv.value, _VALUE_MEMBER[vtype] if 0 <= vtype < len(_VALUE_MEMBER) else "ullVal")
            if key in ("power_mw", "ecc_corrected", "ecc_uncorrected"):
                out[key] = float(raw)
                continue
            ts = fv.timestamp or now_us
            prev = dev.prev.get(key)
            dev.prev[key] = (raw, ts)
            if prev is None or ts <= prev[1]:
                continue
            delta = raw - prev[0]
            if delta < 0:
                wrap = _WRAP.get(vtype)
                if wrap is None:
                    continue  # counter reset: rate unknown for this interval
                delta += wrap
            scale = 1024.0 if key.startswith("nvlink") else 1.0  # NVLink counters are KiB
            out[key] = delta * scale * 1e6 / (ts - prev[1])
        if drop:
            dev.fields = [f for i, f in enumerate(dev.fields) if i not in drop]
            dev.field_keys = [k for i, k in enumerate(dev.field_keys) if i not in drop]
        return out

    def _append_lost(self, cols: dict[str, list[Any]], ts: str, dev: _Device) -> None:
        values = (ts, self.host, dev.index, dev.uuid, dev.model, "nvml", NAN, NAN, NAN, NAN, NAN, NAN, NAN,
                  NAN, NAN, NAN, NAN, NAN, 0, NAN, NAN, NAN, NAN, NAN, NAN, "lost", "", "", "",
                  LOST_TEXT.get(dev.lost_code, LOST_TEXT[ERR_GPU_IS_LOST]))
        for c, v in zip(SAMPLE_COLUMNS, values, strict=True):
            cols[c].append(v)

    def _sample_device(self, dev: _Device, cols: dict[str, list[Any]], procs: dict[str, list[Any]] | None,
                       ts: str, now_us: int) -> None:
        mem = self._call(dev, "memory")
        util = self._call(dev, "util")
        sm_clock = self._call(dev, "sm_clock")
        temp = self._call(dev, "temp")
        reasons = self._call(dev, "reasons")
        f = self._fields(dev, now_us)
        power_mw = f.get("power_mw")
        if power_mw is None:
            power_mw = self._call(dev, "power")
        gpm = (NAN, NAN, NAN)
        if dev.gpm is not None:
            try:
                gpm = dev.gpm.read()
            except self._error_cls as exc:  # type: ignore[misc]
                if _code(exc) in LOST_ERRORS:
                    raise _Lost(_code(exc)) from None
                if _code(exc) in PERMANENT_ERRORS:
                    log.info("nvml: GPU %d: GPM not available (%s)", dev.index, exc)
                    dev.gpm.free()
                    dev.gpm = None
        if mem is not None:
            used, total = float(mem.used), float(mem.total)
            reserved = float(mem.reserved) if hasattr(mem, "reserved") else NAN
        else:
            used = total = reserved = NAN
        values = (
            ts, self.host, dev.index, dev.uuid, dev.model, "nvml", used, total, reserved,
            util.gpu / 100.0 if util is not None else NAN,
            util.memory / 100.0 if util is not None else NAN,
            gpm[0], gpm[1], gpm[2], NAN,
            sm_clock * 1e6 if sm_clock is not None else NAN,
            power_mw / 1000.0 if power_mw is not None else NAN,
            float(temp) if temp is not None else NAN,
            int(reasons) & 0x7FFF_FFFF_FFFF_FFFF if reasons is not None else 0,  # chDB casts ints < 2**63
            f.get("pcie_tx", NAN), f.get("pcie_rx", NAN), f.get("nvlink_tx", NAN), f.get("nvlink_rx", NAN),
            f.get("ecc_corrected", NAN), f.get("ecc_uncorrected", NAN), "ok", "", "", "", "",
        )
        for c, v in zip(SAMPLE_COLUMNS, values, strict=True):
            cols[c].append(v)
        if procs is not None:
            running = self._call(dev, "procs")
            for p in running or ():
                used_p = p.usedGpuMemory
                for c, v in zip(PROCESS_COLUMNS, (ts, self.host, dev.index, int(p.pid), self._name(int(p.pid)),
                                                  float(used_p) if used_p is not None else NAN), strict=True):
                    procs[c].append(v)

    def _name(self, pid: int) -> str:
        name = self._names.get(pid)
        if name is None:
            if len(self._names) > 4096:
                self._names.clear()
            nv = self._nv
            name = self._text(lambda: nv.nvmlSystemGetProcessName(pid))  # type: ignore[union-attr]
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
        except self._error_cls:  # type: ignore[misc]
            return False
        if dev.gpm is not None:
            dev.gpm.free()
        fresh = _Device(dev.index, handle, dev.uuid or self._text(lambda: nv.nvmlDeviceGetUUID(handle)),
                        dev.model or self._text(lambda: nv.nvmlDeviceGetName(handle)))
        self._prepare(fresh)
        self.devices[i] = fresh
        log.warning("nvml: GPU %d answers again", dev.index)
        return True

    def sample_once(self, now_ns: int | None = None) -> dict[str, dict[str, list[Any]]]:
        """One sample of every GPU: ``{"gpu_samples": cols, "gpu_process_memory": cols}`` (no empty tables).

        Returns ``{}`` while NVML is unavailable or there is no GPU (init is retried every ``retry_s``)."""
        mono = time.monotonic()
        if not self.devices:
            if self.state == "unavailable" and not self._no_module and mono >= self._retry_at:
                self.start()
            if not self.devices:
                return {}
        now_ns = time.time_ns() if now_ns is None else now_ns
        ts = encode_ts(now_ns)
        now_us = now_ns // 1000
        cols = _empty(SAMPLE_COLUMNS)
        procs = None
        if self.process_interval_s >= 0 and mono >= self._next_procs:
            procs = _empty(PROCESS_COLUMNS)
            self._next_procs = mono + self.process_interval_s
        changed = False
        for i in range(len(self.devices)):
            dev = self.devices[i]
            if dev.lost:
                if mono < dev.retry_at or not self._reprobe(i, mono):
                    self._append_lost(cols, ts, dev)
                    continue
                dev = self.devices[i]
                changed = True
            start = len(cols["ts"])
            try:
                self._sample_device(dev, cols, procs, ts, now_us)
            except _Lost as exc:
                dev.lost_code = int(exc.args[0]) if exc.args else ERR_GPU_IS_LOST
                for c in SAMPLE_COLUMNS:
                    del cols[c][start:]
                dev.lost = True
                dev.retry_at = mono + self.retry_s
                dev.prev.clear()
                self._append_lost(cols, ts, dev)
                changed = True
        if changed:
            self._refresh_state()
        self.samples += 1
        out: dict[str, dict[str, list[Any]]] = {SAMPLES_TABLE: cols}
        if procs is not None and procs["ts"]:
            out[PROCESS_TABLE] = procs
        return out

    def collect(self) -> dict[str, dict[str, list[Any]]]:
        """Collector protocol: one sample (see :meth:`sample_once`)."""
        return self.sample_once()


def factory(config: dict[str, Any]) -> NvmlSampler:
    """Collector factory for ``triscope run``."""
    return NvmlSampler(config)
