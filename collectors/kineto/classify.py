"""Map Kineto categories and kernel names to triscope's event kinds and kernel classes.

GPU work is selected by category (``kernel``, ``gpu_memcpy``, ``gpu_memset`` and the 2022-era
``Kernel``/``Memcpy``/``Memset``), never by ``stream != -1``: Triton host ops and other CPU
events can carry a stream argument.
"""

from __future__ import annotations

import re

KIND_BY_CATEGORY: dict[str, str] = {
    "kernel": "kernel",
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
    "cuda_sync": "sync",
    "python_function": "python",
}

GPU_WORK_KINDS = frozenset({"kernel", "memcpy", "memset"})

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
    return KIND_BY_CATEGORY.get(category) or KIND_BY_CATEGORY.get(category.lower(), "other")


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
