"""A ``pynvml`` stand-in over simulated GPUs: a test double for machines without a GPU.

It sits at the nvidia-ml-py module boundary only, for tests/test_nvml.py, tools/nvml_check.py's
tests and bench/collect_overhead.py. The module object holds every constant, ctypes struct and
``NVMLError`` subclass of the real ``pynvml``; only its library entry points (``nvmlInit``,
``nvmlDeviceGet*``, ``nvmlGpm*``) are replaced by functions over :class:`FakeGpu` objects. Like
the real bindings they raise ``pynvml.NVMLError`` (mapped to the real subclasses, e.g.
``NVMLError_GpuIsLost``), return the real ctypes structs and friendly objects for processes.
"""

from __future__ import annotations

import ctypes
import types
from dataclasses import dataclass, field
from typing import Any

import pynvml as real

MiB = 1 << 20


@dataclass
class FakeGpu:
    """A simulated GPU: instantaneous readings plus cumulative counters advanced by :meth:`advance`."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-52e6b438-f2a7-269e-6513-0c5ca6a3a450"
    total: int = 81559 * MiB
    reserved: int = 553 * MiB
    used: int = 40000 * MiB
    util_gpu: int = 97
    util_mem: int = 41
    sm_mhz: int = 1980
    power_mw: int = 512331
    temp_c: int = 58
    reasons: int = 0x20  # clocksEventReasonSwThermalSlowdown... any bitmask
    pcie_tx: int = 10_000
    pcie_rx: int = 20_000
    nvlink_tx_kib: int = 1_000
    nvlink_rx_kib: int = 2_000
    ecc_sbe: int = 3
    ecc_dbe: int = 0
    gpm_supported: bool = True
    gpm: dict[int, float] = field(default_factory=lambda: {2: 80.0, 3: 45.0, 10: 30.0})  # percent
    gpm_integral: dict[int, float] = field(default_factory=lambda: {2: 0.0, 3: 0.0, 10: 0.0})
    processes: list[tuple[int, int | None]] = field(default_factory=lambda: [(4242, 39000 * MiB)])
    lost: bool = False
    unsupported_calls: set[str] = field(default_factory=set)
    unsupported_fields: set[int] = field(default_factory=set)
    failing_once: dict[str, int] = field(default_factory=dict)  # call -> NVML error code, raised once
    pcie_type: int = real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG


class Clock:
    """The stand-in's notion of time (NVML field timestamps are microseconds)."""

    def __init__(self) -> None:
        self.us = 1_750_000_000_000_000


def advance(gpus: list[FakeGpu], clock: Clock, seconds: float, pcie_tx_bps: float = 0, pcie_rx_bps: float = 0,
            nvlink_tx_bps: float = 0, nvlink_rx_bps: float = 0) -> None:
    """Let ``seconds`` pass with the given traffic rates on every GPU."""
    clock.us += round(seconds * 1e6)
    for g in gpus:
        mod = (1 << 32) if g.pcie_type == real.NVML_VALUE_TYPE_UNSIGNED_INT else (1 << 64)
        g.pcie_tx = (g.pcie_tx + round(pcie_tx_bps * seconds)) % mod
        g.pcie_rx = (g.pcie_rx + round(pcie_rx_bps * seconds)) % mod
        g.nvlink_tx_kib += round(nvlink_tx_bps * seconds / 1024)
        g.nvlink_rx_kib += round(nvlink_rx_bps * seconds / 1024)
        for k, pct in g.gpm.items():
            g.gpm_integral[k] += pct * seconds


KEEP = {"nvmlFriendlyObject", "nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct", "nvmlExceptionClass"}


def standin(gpus: list[FakeGpu], clock: Clock | None = None, init_error: int | None = None) -> types.ModuleType:
    """A ``pynvml`` module over simulated GPUs (see the module docstring)."""
    clock = clock or Clock()
    m = types.ModuleType("pynvml")
    for name in dir(real):
        if not name.startswith("__"):
            setattr(m, name, getattr(real, name))
    calls: dict[str, int] = {}
    m.calls = calls  # type: ignore[attr-defined]
    m.clock = clock  # type: ignore[attr-defined]
    state: dict[str, Any] = {"init": 0, "init_error": init_error}
    m.state = state  # type: ignore[attr-defined]

    def not_found(name: str) -> Any:
        def fn(*args: Any, **kwargs: Any) -> Any:
            raise real.NVMLError(real.NVML_ERROR_FUNCTION_NOT_FOUND)
        fn.__name__ = name
        return fn

    for name in dir(real):  # entry points this stand-in does not simulate behave as absent from the driver
        if name.startswith("nvml") and callable(getattr(real, name)) and name not in KEEP:
            setattr(m, name, not_found(name))

    structs = [real.struct_c_nvmlDevice_t() for _ in gpus]
    handles = [ctypes.pointer(s) for s in structs]
    by_addr = {ctypes.addressof(s): g for s, g in zip(structs, gpus, strict=True)}
    gpm_buffers: list[Any] = []
    gpm_records: dict[int | None, tuple[int, dict[int, float]]] = {}

    def api(fn: Any) -> Any:
        name = fn.__name__

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            if name not in ("nvmlInit",) and not state["init"]:
                raise real.NVMLError(real.NVML_ERROR_UNINITIALIZED)
            return fn(*args, **kwargs)
        wrapper.__name__ = name
        setattr(m, name, wrapper)
        return wrapper

    def gpu_of(handle: Any, name: str) -> FakeGpu:
        g = by_addr[ctypes.addressof(handle.contents)]
        if g.lost:
            raise real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)
        if name in g.unsupported_calls:
            raise real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
        if name in g.failing_once:
            raise real.NVMLError(g.failing_once.pop(name))
        return g

    @api
    def nvmlInit() -> None:
        if state["init_error"] is not None:
            raise real.NVMLError(state["init_error"])
        state["init"] += 1

    @api
    def nvmlShutdown() -> None:
        state["init"] -= 1

    @api
    def nvmlDeviceGetCount() -> int:
        return len(gpus)

    @api
    def nvmlDeviceGetHandleByIndex(index: int) -> Any:
        if not 0 <= index < len(gpus):
            raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
        if gpus[index].lost:
            raise real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)
        return handles[index]

    def reading(name: str, attr: str, extra: tuple[int, int] = (0, 0)) -> None:
        """Entry point ``name(handle, *args)`` returning the GPU's ``attr``; ``extra`` bounds how many
        arguments follow the handle (they are accepted and ignored, like a sensor id)."""
        def fn(handle: Any, *args: Any) -> Any:
            if not extra[0] <= len(args) <= extra[1]:
                raise TypeError(f"{name}() takes {1 + extra[0]} to {1 + extra[1]} arguments, got {1 + len(args)}")
            return getattr(gpu_of(handle, name), attr)
        fn.__name__ = name
        api(fn)

    for name, attr, extra in (
            ("nvmlDeviceGetUUID", "uuid", (0, 0)),
            ("nvmlDeviceGetName", "name", (0, 0)),
            ("nvmlDeviceGetTemperatureV", "temp_c", (1, 2)),  # (handle, sensor, version=v1)
            ("nvmlDeviceGetTemperature", "temp_c", (1, 1)),  # (handle, sensor)
            ("nvmlDeviceGetCurrentClocksEventReasons", "reasons", (0, 0)),
            ("nvmlDeviceGetCurrentClocksThrottleReasons", "reasons", (0, 0)),
            ("nvmlDeviceGetPowerUsage", "power_mw", (0, 0))):
        reading(name, attr, extra)

    @api
    def nvmlDeviceGetMemoryInfo(handle: Any, version: int | None = None) -> Any:
        if version:
            g = gpu_of(handle, "nvmlDeviceGetMemoryInfo_v2")
            if version != real.nvmlMemory_v2:
                raise real.NVMLError(real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            mem = real.c_nvmlMemory_v2_t()
            mem.version = version
            mem.total, mem.reserved, mem.used = g.total, g.reserved, g.used
            mem.free = g.total - g.reserved - g.used
            return mem
        g = gpu_of(handle, "nvmlDeviceGetMemoryInfo")
        mem = real.c_nvmlMemory_t()
        mem.total, mem.used = g.total, g.used + g.reserved
        mem.free = g.total - mem.used
        return mem

    @api
    def nvmlDeviceGetUtilizationRates(handle: Any) -> Any:
        g = gpu_of(handle, "nvmlDeviceGetUtilizationRates")
        u = real.c_nvmlUtilization_t()
        u.gpu, u.memory = g.util_gpu, g.util_mem
        return u

    @api
    def nvmlDeviceGetClockInfo(handle: Any, clock_type: int) -> int:
        g = gpu_of(handle, "nvmlDeviceGetClockInfo")
        if clock_type != real.NVML_CLOCK_SM:
            raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
        return g.sm_mhz

    @api
    def nvmlDeviceGetFieldValues(handle: Any, field_ids: list[Any]) -> Any:
        g = gpu_of(handle, "nvmlDeviceGetFieldValues")
        values = (real.c_nvmlFieldValue_t * len(field_ids))()
        ull = real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        table = {
            real.NVML_FI_DEV_POWER_INSTANT: (real.NVML_VALUE_TYPE_UNSIGNED_INT, g.power_mw),
            real.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: (g.pcie_type, g.pcie_tx),
            real.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: (g.pcie_type, g.pcie_rx),
            real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: (ull, g.nvlink_tx_kib),
            real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: (ull, g.nvlink_rx_kib),
            real.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: (ull, g.ecc_sbe),
            real.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: (ull, g.ecc_dbe),
            real.NVML_FI_DEV_ECC_SBE_AGG_TOTAL: (ull, g.ecc_sbe + 100),
            real.NVML_FI_DEV_ECC_DBE_AGG_TOTAL: (ull, g.ecc_dbe + 100),
        }
        member = {real.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal", ull: "ullVal"}
        for i, fid in enumerate(field_ids):
            fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
            values[i].fieldId, values[i].scopeId = fid, scope
            values[i].timestamp = clock.us
            values[i].latencyUsec = 3
            if fid in g.unsupported_fields or fid not in table:
                values[i].nvmlReturn = real.NVML_ERROR_NOT_SUPPORTED
                continue
            if fid in (real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX) \
                    and scope != 0xFFFFFFFF:
                values[i].nvmlReturn = real.NVML_ERROR_INVALID_ARGUMENT  # this GPU only answers the all-links sum
                continue
            vtype, value = table[fid]
            values[i].valueType = vtype
            setattr(values[i].value, member[vtype], value)
            values[i].nvmlReturn = real.NVML_SUCCESS
        return values

    @api
    def nvmlDeviceGetComputeRunningProcesses(handle: Any) -> list[Any]:
        g = gpu_of(handle, "nvmlDeviceGetComputeRunningProcesses")
        out = []
        for pid, used in g.processes:
            info = real.c_nvmlProcessInfo_v3_t()
            info.pid = pid
            info.usedGpuMemory = used if used is not None else real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
            obj = real.nvmlStructToFriendlyObject(info)
            if obj.usedGpuMemory == real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None
            out.append(obj)
        return out

    @api
    def nvmlSystemGetProcessName(pid: int) -> str:
        if pid == 4242:
            return "python3 -m vllm.entrypoints.openai.api_server"
        raise real.NVMLError(real.NVML_ERROR_NOT_FOUND)

    @api
    def nvmlGpmQueryDeviceSupport(handle: Any) -> Any:
        g = gpu_of(handle, "nvmlGpmQueryDeviceSupport")
        sup = real.c_nvmlGpmSupport_t()
        sup.version = real.NVML_GPM_SUPPORT_VERSION
        sup.isSupportedDevice = int(g.gpm_supported)
        return sup

    @api
    def nvmlGpmSampleAlloc() -> Any:
        buf = (ctypes.c_char * 64)()
        gpm_buffers.append(buf)
        return ctypes.cast(buf, real.c_nvmlGpmSample_t)

    @api
    def nvmlGpmSampleFree(sample: Any) -> None:
        gpm_records.pop(ctypes.cast(sample, ctypes.c_void_p).value, None)

    @api
    def nvmlGpmSampleGet(handle: Any, sample: Any) -> Any:
        g = gpu_of(handle, "nvmlGpmSampleGet")
        gpm_records[ctypes.cast(sample, ctypes.c_void_p).value] = (clock.us, dict(g.gpm_integral))
        return sample

    @api
    def nvmlGpmMetricsGet(mg: Any) -> Any:
        if mg.version != real.NVML_GPM_METRICS_GET_VERSION:
            raise real.NVMLError(real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        t1, i1 = gpm_records[ctypes.cast(mg.sample1, ctypes.c_void_p).value]
        t2, i2 = gpm_records[ctypes.cast(mg.sample2, ctypes.c_void_p).value]
        if t2 <= t1:
            raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
        for k in range(mg.numMetrics):
            metric = mg.metrics[k]
            if metric.metricId in i1:
                metric.value = (i2[metric.metricId] - i1[metric.metricId]) / ((t2 - t1) / 1e6)
                metric.nvmlReturn = real.NVML_SUCCESS
            else:
                metric.nvmlReturn = real.NVML_ERROR_NOT_SUPPORTED
        return mg

    return m
