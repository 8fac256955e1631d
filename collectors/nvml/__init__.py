"""NVML sampler for ``gpu_samples`` and ``gpu_process_memory`` (nvidia-ml-py, module ``pynvml``).

Per GPU and sample: memory (``nvmlMemory_v2``), utilization, SM clock, temperature, clock-event
reasons and, in one ``nvmlDeviceGetFieldValues`` call, power, PCIe/NVLink byte counters (as rates
over the field timestamps) and ECC totals; GPM (Hopper+) SM activity, occupancy and DRAM
bandwidth. Failure states (NVML missing, no GPU, a lost GPU, an unsupported metric) never raise
out of ``collect()``: see docs/gpu-collectors.md. Registry name ``nvml`` -> :func:`create`;
config section ``[nvml]`` (:class:`NvmlConfig`).
"""

from __future__ import annotations

from typing import Any

from triscope.collectors.nvml.config import NvmlConfig
from triscope.collectors.nvml.device import Device, Gpm
from triscope.collectors.nvml.sampler import NvmlSampler
from triscope.component import Context

__all__ = ["Device", "Gpm", "NvmlConfig", "NvmlSampler", "create"]


def create(config: dict[str, Any], context: Context) -> NvmlSampler:
    """The NVML sampler (``[nvml]``)."""
    return NvmlSampler(NvmlConfig.from_config(config))
