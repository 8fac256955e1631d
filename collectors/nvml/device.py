"""One GPU as NVML sees it: its bound calls, the batched field-values request, GPM samples, counter rates."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

# NVML return codes (nvml.h; same values as pynvml.NVML_ERROR_*).
ERR_INVALID_ARGUMENT = 2
ERR_NOT_SUPPORTED = 3
ERR_NO_PERMISSION = 4
ERR_FUNCTION_NOT_FOUND = 13
ERR_GPU_IS_LOST = 15
ERR_RESET_REQUIRED = 16
PERMANENT_ERRORS = frozenset({ERR_INVALID_ARGUMENT, ERR_NOT_SUPPORTED, ERR_NO_PERMISSION, ERR_FUNCTION_NOT_FOUND})
LOST_ERRORS = frozenset({ERR_GPU_IS_LOST, ERR_RESET_REQUIRED})
LOST_TEXT = {ERR_GPU_IS_LOST: "NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus",
             ERR_RESET_REQUIRED: "NVML_ERROR_RESET_REQUIRED: the GPU needs a reset"}

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
_INSTANT_FIELDS = ("power_mw", "ecc_corrected", "ecc_uncorrected")

NAN = math.nan
ErrorClass = type[Exception]
Getter = tuple[Callable[..., Any], tuple[Any, ...]]


class Lost(Exception):
    """The GPU answered GPU_IS_LOST / RESET_REQUIRED (``args[0]``: the NVML code)."""


def code(exc: BaseException) -> int:
    """The NVML return code of an ``NVMLError`` (-1 for anything else)."""
    return int(getattr(exc, "value", -1))


def const(nv: ModuleType, name: str, default: int) -> int:
    """A ``pynvml`` constant, or ``default`` when this nvidia-ml-py predates it."""
    return int(getattr(nv, name, default))


def text(fn: Callable[[], Any], error: ErrorClass) -> str:
    """A string NVML returns (bytes on old bindings), or "" when the call fails."""
    try:
        value = fn()
    except error:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


class Gpm:
    """Two alternating GPM samples and one reusable metrics-get struct."""

    def __init__(self, nv: ModuleType, handle: Any) -> None:
        self.nv = nv
        self.handle = handle
        self.samples = [nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()]
        self.cur = 0
        self.primed = False
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = const(nv, "NVML_GPM_METRICS_GET_VERSION", 1)
        ids = (const(nv, "NVML_GPM_METRIC_SM_UTIL", GPM_SM_UTIL),
               const(nv, "NVML_GPM_METRIC_SM_OCCUPANCY", GPM_SM_OCCUPANCY),
               const(nv, "NVML_GPM_METRIC_DRAM_BW_UTIL", GPM_DRAM_BW_UTIL))
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
            sm, occ, dram = (m[i].value / 100.0 if m[i].nvmlReturn == 0 else NAN for i in range(3))
            out = (sm, occ, dram)
        self.primed = True
        self.cur = 1 - self.cur
        return out

    def free(self) -> None:
        for s in self.samples:
            with contextlib.suppress(Exception):  # best effort on shutdown
                self.nv.nvmlGpmSampleFree(s)


class Device:
    """Per-GPU handle, prepared calls and counter baselines; ``error`` is ``pynvml.NVMLError``."""

    def __init__(self, nv: ModuleType, error: ErrorClass, index: int, handle: Any, uuid: str, model: str) -> None:
        self.nv, self.error = nv, error
        self.index = index
        self.handle = handle
        self.uuid = uuid
        self.model = model
        self.lost = False
        self.lost_code = ERR_GPU_IS_LOST
        self.retry_at = 0.0
        self.getters: dict[str, list[Getter]] = {}
        """key -> alternative (callable, args); the first that works is kept."""
        self.fields: list[tuple[int, int]] = []   # (fieldId, scopeId) requested in one call
        self.field_keys: list[str] = []            # what each entry means
        self.prev: dict[str, tuple[int, int]] = {}  # counter key -> (value, timestamp us)
        self.gpm: Gpm | None = None
        self.warned: set[tuple[str, int]] = set()

    @property
    def lost_text(self) -> str:
        return LOST_TEXT.get(self.lost_code, LOST_TEXT[ERR_GPU_IS_LOST])

    def prepare(self, ecc: str, use_gpm: bool) -> None:
        """Bind each metric's NVML call(s) once so a sample only calls them."""
        nv, h, g = self.nv, self.handle, self.getters

        def alts(*pairs: tuple[str, tuple[Any, ...]]) -> list[Getter]:
            return [(getattr(nv, fn), args) for fn, args in pairs if hasattr(nv, fn)]

        mem_v2 = getattr(nv, "nvmlMemory_v2", None)
        g["memory"] = alts(*((("nvmlDeviceGetMemoryInfo", (h, mem_v2)),) if mem_v2 else ()),
                           ("nvmlDeviceGetMemoryInfo", (h,)))
        g["util"] = alts(("nvmlDeviceGetUtilizationRates", (h,)))
        g["sm_clock"] = alts(("nvmlDeviceGetClockInfo", (h, const(nv, "NVML_CLOCK_SM", 1))))
        sensor = const(nv, "NVML_TEMPERATURE_GPU", 0)
        g["temp"] = alts(("nvmlDeviceGetTemperatureV", (h, sensor)), ("nvmlDeviceGetTemperature", (h, sensor)))
        g["reasons"] = alts(("nvmlDeviceGetCurrentClocksEventReasons", (h,)),
                            ("nvmlDeviceGetCurrentClocksThrottleReasons", (h,)))
        g["power"] = alts(("nvmlDeviceGetPowerUsage", (h,)))
        g["procs"] = alts(("nvmlDeviceGetComputeRunningProcesses", (h,)))
        sbe, dbe = (("NVML_FI_DEV_ECC_SBE_VOL_TOTAL", FI_ECC_SBE_VOL_TOTAL),
                    ("NVML_FI_DEV_ECC_DBE_VOL_TOTAL", FI_ECC_DBE_VOL_TOTAL))
        if ecc == "aggregate":
            sbe, dbe = (("NVML_FI_DEV_ECC_SBE_AGG_TOTAL", FI_ECC_SBE_AGG_TOTAL),
                        ("NVML_FI_DEV_ECC_DBE_AGG_TOTAL", FI_ECC_DBE_AGG_TOTAL))
        wanted = [
            ("power_mw", const(nv, "NVML_FI_DEV_POWER_INSTANT", FI_POWER_INSTANT), 0),
            ("pcie_tx", const(nv, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", FI_PCIE_COUNT_TX_BYTES), 0),
            ("pcie_rx", const(nv, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", FI_PCIE_COUNT_RX_BYTES), 0),
            ("nvlink_tx", const(nv, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", FI_NVLINK_THROUGHPUT_DATA_TX),
             SCOPE_ALL_LINKS),
            ("nvlink_rx", const(nv, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", FI_NVLINK_THROUGHPUT_DATA_RX),
             SCOPE_ALL_LINKS),
            ("ecc_corrected", const(nv, *sbe), 0),
            ("ecc_uncorrected", const(nv, *dbe), 0),
        ]
        self.field_keys = [k for k, _, _ in wanted]
        self.fields = [(fid, scope) for _, fid, scope in wanted]
        if use_gpm and hasattr(nv, "nvmlGpmQueryDeviceSupport"):
            try:
                if nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice:
                    self.gpm = Gpm(nv, h)
            except self.error as exc:
                if code(exc) not in PERMANENT_ERRORS:
                    log.info("nvml: GPU %d: GPM unavailable: %s", self.index, exc)

    def call(self, key: str) -> Any:
        """Value of a prepared metric, or None (unsupported, or a transient error this sample); Lost."""
        options = self.getters.get(key)
        while options:
            fn, args = options[0]
            try:
                return fn(*args)
            except self.error as exc:
                err = code(exc)
                if err in LOST_ERRORS:
                    raise Lost(err) from None
                if err in PERMANENT_ERRORS:
                    options.pop(0)
                    if not options:
                        log.info("nvml: GPU %d: %s not available (%s)", self.index, key, exc)
                    continue
                if (key, err) not in self.warned:
                    self.warned.add((key, err))
                    log.warning("nvml: GPU %d: %s failed: %s (code %d); NaN for now", self.index, key, exc, err)
                return None
        return None

    def read_fields(self, now_us: int) -> dict[str, float]:
        """One nvmlDeviceGetFieldValues call: instantaneous values and counter rates; Lost."""
        out: dict[str, float] = {}
        if not self.fields:
            return out
        try:
            values = self.nv.nvmlDeviceGetFieldValues(self.handle, self.fields)
        except self.error as exc:
            err = code(exc)
            if err in LOST_ERRORS:
                raise Lost(err) from None
            if err in PERMANENT_ERRORS:
                log.info("nvml: GPU %d: field values not available (%s)", self.index, exc)
                self.fields, self.field_keys = [], []
            return out
        drop: list[int] = []
        for i, key in enumerate(self.field_keys):
            fv = values[i]
            ret = fv.nvmlReturn
            if ret != 0:
                if ret in LOST_ERRORS:
                    raise Lost(ret)
                if ret in PERMANENT_ERRORS:
                    drop.append(i)
                continue
            vtype = fv.valueType
            raw = getattr(fv.value, _VALUE_MEMBER[vtype] if 0 <= vtype < len(_VALUE_MEMBER) else "ullVal")
            if key in _INSTANT_FIELDS:
                out[key] = float(raw)
                continue
            rate = self._rate(key, raw, fv.timestamp or now_us, vtype)
            if rate is not None:
                out[key] = rate
        if drop:
            self.fields = [f for i, f in enumerate(self.fields) if i not in drop]
            self.field_keys = [k for i, k in enumerate(self.field_keys) if i not in drop]
        return out

    def _rate(self, key: str, raw: int, ts_us: int, vtype: int) -> float | None:
        """Per-second rate of counter ``key`` since its previous reading; None without one or on a reset."""
        prev = self.prev.get(key)
        self.prev[key] = (raw, ts_us)
        if prev is None or ts_us <= prev[1]:
            return None
        delta = raw - prev[0]
        if delta < 0:
            wrap = _WRAP.get(vtype)
            if wrap is None:
                return None  # counter reset: rate unknown for this interval
            delta += wrap
        scale = 1024.0 if key.startswith("nvlink") else 1.0  # NVLink counters are KiB
        return delta * scale * 1e6 / (ts_us - prev[1])

    def read_gpm(self) -> tuple[float, float, float]:
        """GPM ratios (NaN without GPM); a GPM that turns out unsupported is freed; Lost."""
        if self.gpm is None:
            return NAN, NAN, NAN
        try:
            return self.gpm.read()
        except self.error as exc:
            if code(exc) in LOST_ERRORS:
                raise Lost(code(exc)) from None
            if code(exc) in PERMANENT_ERRORS:
                log.info("nvml: GPU %d: GPM not available (%s)", self.index, exc)
                self.free()
            return NAN, NAN, NAN

    def free(self) -> None:
        """Release the GPM samples."""
        if self.gpm is not None:
            self.gpm.free()
            self.gpm = None
