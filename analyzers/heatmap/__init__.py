"""QPS x GPU memory x latency heatmap, computed in ClickHouse.

Every request lands in one cell of a ``[qps_bins, memory_bins, latency_bins]`` tensor (default
``[32, 64, 128]``): its backend's QPS in its analysis window, the GPU memory used by the backend's GPU in
that window, and its latency. Definitions, binning and the SQL are described in docs/heatmap.md.

Modules: :mod:`.config` (``[heatmap]``), :mod:`.result` (the tensor and its summaries), :mod:`.queries`
(the SQL and :func:`compute_heatmap`).
"""

from triscope.analyzers.heatmap.config import HeatmapConfig, HeatmapSpec
from triscope.analyzers.heatmap.queries import (
    cell_summary_query,
    compute_heatmap,
    summary_query,
    tensor_query,
    time_range,
)
from triscope.analyzers.heatmap.result import AXES, HeatmapResult, slice_axes

__all__ = ["AXES", "HeatmapConfig", "HeatmapResult", "HeatmapSpec", "cell_summary_query", "compute_heatmap",
           "slice_axes", "summary_query", "tensor_query", "time_range"]
