"""Map Kineto categories and kernel names to triscope's event kinds and kernel classes.

Device work is selected by category: CUDA and ROCm (``kernel``, ``gpu_memcpy``, ``gpu_memset`` and
the 2022-era ``Kernel``/``Memcpy``/``Memset``) and MTIA (``mtia_ccp_events``), never by
``stream != -1`` alone: Triton host ops and other CPU events can carry a stream argument. Any
``*_runtime`` / ``*_driver`` category is a host-side runtime call. Device work of a category not
known here is recognised after ingest by where it ran (:func:`.runs.recognise_device_work`: a
stream argument on a pid that has no host events). Device work without a ``device`` argument
(MTIA) takes its device from its pid, which Kineto sets to the device index.

Two kinds of device activity are stored but are not device work: ``profiler_range`` (CUPTI range
profiler measurements, ``cuda_profiler_range``: counters per range, written instead of kernel
events) and ``device_other`` (device work on no stream that no runtime call launched, such as an
MTIA DMA engine's own device-to-host transfers: not work the program issued, and left out of the
breakdown as HolisticTraceAnalysis leaves it out). docs/trace-breakdown.md has the why.
"""

from __future__ import annotations

import re

KIND_BY_CATEGORY: dict[str, str] = {
    "kernel": "kernel",
    "mtia_ccp_events": "kernel",
    "gpu_memcpy": "memcpy",
    "memcpy": "memcpy",
    "gpu_memset": "memset",
    "memset": "memset",
    "cuda_runtime": "runtime",
    "cuda_driver": "runtime",
    "runtime": "runtime",
    "driver": "runtime",
    "cpu_op": "cpu_op",
    "operator": "cpu_op",
    "user_annotation": "user_annotation",
    "gpu_user_annotation": "gpu_user_annotation",
    "mtia_runtime": "runtime",
    "hpu_op": "runtime",  # Kineto: "HPU host side runtime event"
    "cuda_sync": "sync",
    "python_function": "python",
    "cuda_profiler_range": "profiler_range",
}
RUNTIME_SUFFIXES = ("_runtime", "_driver")
"""Categories ending so are host-side runtime calls of any device (xpu_runtime, privateuse1_driver, ...)."""
PROFILER_RANGE_SUFFIX = "_profiler_range"
"""Categories ending so are range-profiler measurements of a device (``cuda_profiler_range``)."""

GPU_WORK_KINDS = frozenset({"kernel", "memcpy", "memset"})
DEVICE_KINDS = GPU_WORK_KINDS | {"profiler_range", "device_other"}
"""Kinds of device activity: without a ``device`` argument they take the device their pid names."""
OFF_STREAM_KIND = "device_other"

# NCCL/RCCL kernels of both naming eras (ncclKernel_* before 2.19, ncclDevKernel_* after) and
# collectives implemented outside NCCL (vLLM custom all-reduce, torch symmetric memory, ...).
DEFAULT_COMM_KERNEL_PATTERN = (
    r"^(nccl|rccl)\w*Kernel"
    r"|cross_device_reduce"
    r"|(one|two)_shot_all_reduce"
    r"|multimem_(all_reduce|all_gather|reduce_scatter)"
    r"|^(void )?(\w+::)*(custom_)?all_reduce_kernel"
)
_MEMORY_NAME = re.compile(r"^(Memcpy|Memset|dma)")
_INT_TEXT = re.compile(r"[+-]?[0-9]+")

_comm_re = re.compile(DEFAULT_COMM_KERNEL_PATTERN)


def set_comm_kernel_pattern(pattern: str) -> None:
    """Replace the regular expression (RE2-compatible) that marks a GPU kernel as communication."""
    global _comm_re
    _comm_re = re.compile(pattern)


def comm_kernel_pattern() -> str:
    """The regular expression in use (also evaluated by ClickHouse during ingest)."""
    return _comm_re.pattern


def event_kind(category: str) -> str:
    """triscope kind for a Kineto ``cat`` value (``other`` when unknown)."""
    kind = KIND_BY_CATEGORY.get(category) or KIND_BY_CATEGORY.get(category.lower())
    if kind is None:
        lower = category.lower()
        if lower.endswith(RUNTIME_SUFFIXES):
            return "runtime"
        return "profiler_range" if lower.endswith(PROFILER_RANGE_SUFFIX) else "other"
    return kind


def stream_kind(kind: str, stream: int | None, correlation: int | None) -> str:
    """``kind``, or :data:`OFF_STREAM_KIND` for device work with neither a stream nor a correlation id
    (not launched by the program: a DMA engine's own transfers)."""
    if kind in GPU_WORK_KINDS and stream is None and correlation is None:
        return OFF_STREAM_KIND
    return kind


def pid_device(pid: int | str) -> int:
    """The device index a device event's pid stands for (Kineto writes the device index as the pid),
    -1 when it is not an Int32 number; read as ClickHouse's ``toInt32OrDefault(pid, -1)`` reads it."""
    text = str(pid)
    if not _INT_TEXT.fullmatch(text):
        return -1
    value = int(text)
    return value if -(1 << 31) <= value < (1 << 31) else -1


def kernel_class(kind: str, name: str) -> str:
    """``compute``, ``comm`` or ``memory`` for GPU work; empty for host events."""
    if kind not in GPU_WORK_KINDS:
        return ""
    if kind != "kernel" or _MEMORY_NAME.match(name):
        return "memory"
    # Strip a leading "void " so names written as C++ signatures match too.
    bare = name[5:] if name.startswith("void ") else name
    if _comm_re.search(bare):
        return "comm"
    return "compute"


_GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})
_GPU_WORDS = frozenset({"gpu", "cuda", "hip", "rocm"})


def device_type(category: str) -> str:
    """The kind of device a device-activity category ran on: ``GPU`` (CUDA and ROCm write the same
    categories; ``cuda_profiler_range``), ``MTIA``, else the category's first word (``npu_events`` -> ``NPU``)."""
    cat = category.lower()
    word = cat.split("_", 1)[0]
    if cat in _GPU_CATEGORIES or word in _GPU_WORDS:
        return "GPU"
    return word.upper() or "GPU"
