"""The routing-weight engine: backend inputs (memory, KV cache, load, tail latency) -> LB weights.

``config`` (``[weights]``), ``model`` (inputs, results, state), ``scoring`` (the formula and
:func:`compute_weights`), ``admission`` (drain and per-class limits), ``store_latest`` (reading
:class:`BackendInputs` from the store's newest-row tables; ``store_inputs`` reads the same from the
raw rows), ``history`` (``weights_history`` rows). The formula is documented in docs/weights.md; the
load-balancer adapters live in ``triscope.exporters``.
"""

from triscope.analyzers.routing.admission import (
    batch_occupancy,
    class_admission,
    down_reasons,
    drain_reasons,
    over_limit,
)
from triscope.analyzers.routing.config import (
    DEFAULT_CLASSES,
    NAN,
    BackendConfig,
    FeedConfig,
    RequestClass,
    WeightParams,
    WeightsConfig,
)
from triscope.analyzers.routing.history import history_columns
from triscope.analyzers.routing.model import (
    DOWN,
    DRAIN,
    READY,
    BackendInputs,
    BackendState,
    BackendWeight,
    EngineState,
    ScaleDecision,
    WeightsResult,
    forget,
    lb_knows,
    split_address,
    with_address,
)
from triscope.analyzers.routing.scoring import (
    class_of,
    class_priorities,
    compute_weights,
    damp,
    factors,
    headroom_penalty,
    latency_penalty,
    lb_weight,
    queue_penalty,
    scale_decision,
)
from triscope.analyzers.routing.store_latest import read_inputs

__all__ = ["DEFAULT_CLASSES", "DOWN", "DRAIN", "NAN", "READY", "BackendConfig", "BackendInputs", "BackendState",
           "BackendWeight", "EngineState", "FeedConfig", "RequestClass", "ScaleDecision", "WeightParams",
           "WeightsConfig", "WeightsResult", "batch_occupancy", "class_admission", "class_of", "class_priorities",
           "compute_weights", "damp", "down_reasons", "drain_reasons", "factors", "forget", "headroom_penalty",
           "history_columns",
           "latency_penalty", "lb_knows", "lb_weight", "over_limit", "queue_penalty", "read_inputs", "scale_decision",
           "split_address", "with_address"]
