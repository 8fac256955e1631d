"""PyTorch CUDA caching-allocator samples for ``allocator_samples``, per device.

From ``torch.cuda.memory_stats(device)``: ``allocated_bytes.all.current``,
``reserved_bytes.all.current``, ``active_bytes.all.current``, ``inactive_split_bytes.all.current``,
``num_alloc_retries``, ``num_ooms``; ``fragmentation_ratio = 1 - allocated/reserved`` (0 when
nothing is reserved). The stats are per process: sample inside the process that allocates,
with one line::

    handle = triscope.collectors.torch_allocator.install(writer_or_store_or_config, interval_s=0.2)
    ...
    handle.close()

From ``triscope run`` (registry key ``torch_allocator`` -> :func:`create`, section
``[torch_allocator]``, :class:`TorchAllocatorConfig`) it samples the daemon's own process, which is only useful
when the daemon runs inside the allocating process. Without CUDA (no torch, a CPU build, no
device) the collector starts in state ``unavailable`` and yields no rows; while the process has
not initialised CUDA yet it is ``not_initialized`` (it never initialises CUDA itself).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triscope.component import ComponentConfig, Context, interval
from triscope.errors import ConfigError, TriscopeError
from triscope.schema import ALLOCATOR_SAMPLES, Table, encode_ts
from triscope.tick_clock import TickClock

log = logging.getLogger(__name__)

STAT_KEYS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "reserved_bytes": "reserved_bytes.all.current",
    "active_bytes": "active_bytes.all.current",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
    "alloc_retries_total": "num_alloc_retries",
    "ooms_total": "num_ooms",
}
"""Column -> ``torch.cuda.memory_stats()`` key (flattened names, torch >= 1.4)."""


@dataclass(frozen=True)
class TorchAllocatorConfig(ComponentConfig):
    """``[torch_allocator]``: ``devices`` is "used" (the current device and any holding memory),
    "all" or a list of device indexes; ``host`` defaults to the machine's hostname."""

    section = "torch_allocator"
    interval_s: float = 1.0
    host: str = ""
    devices: str | list[int] = "used"

    def validate(self, where: str) -> None:
        interval(where, interval_s=self.interval_s)
        devices = self.devices
        if devices not in ("used", "all") and not (isinstance(devices, list) and all(d >= 0 for d in devices)):
            raise ConfigError(f'{where} devices must be "used", "all" or a list of device indexes')


def sample_values(stats: Mapping[str, Any]) -> dict[str, float | int]:
    """The allocator columns from one device's ``memory_stats()`` dict (missing keys count as 0)."""
    out: dict[str, float | int] = {}
    for column, key in STAT_KEYS.items():
        value = stats.get(key, 0) or 0
        out[column] = int(value) if column.endswith("_total") else float(value)
    reserved = float(out["reserved_bytes"])
    out["fragmentation_ratio"] = 1.0 - float(out["allocated_bytes"]) / reserved if reserved > 0 else 0.0
    return out


def _load_cuda() -> tuple[Any, str]:
    """``torch.cuda`` and "" when usable, else (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, f"CUDA is not available (torch {torch.__version__})"
    return torch.cuda, ""


class TorchAllocatorCollector:
    """Samples the caching allocator of this process, one row per device per collect().

    ``cuda`` is the ``torch.cuda`` module (looked up at start() when not given); it must offer
    ``is_available``, ``is_initialized``, ``device_count``, ``current_device`` and ``memory_stats``.
    """

    name = "torch_allocator"

    def __init__(self, config: Mapping[str, Any] | TorchAllocatorConfig | None = None, cuda: Any = None) -> None:
        cfg = config if isinstance(config, TorchAllocatorConfig) else TorchAllocatorConfig.from_config(config)
        self.interval_s = cfg.interval_s
        self._clock = TickClock(cfg.interval_s)
        self.devices = cfg.devices
        self.host = cfg.host or socket.gethostname()
        self.pid = os.getpid()
        self._cuda = cuda
        self.state = "stopped"
        self.reason = ""

    def start(self) -> None:
        """Find torch.cuda; without it the state is ``unavailable`` (one log line), not an error."""
        if self._cuda is None:
            self._cuda, self.reason = _load_cuda()
        elif not self._cuda.is_available():
            self._cuda, self.reason = None, "CUDA is not available"
        if self._cuda is None:
            self.state = "unavailable"
            log.warning("torch_allocator: %s; no allocator samples", self.reason)
            return
        self.state, self.reason = "ok", ""

    def _device_stats(self, cuda: Any) -> dict[int, Mapping[str, Any]]:
        """memory_stats() of the configured devices; "used": the current one and any holding memory."""
        count = int(cuda.device_count())
        if isinstance(self.devices, list):
            return {d: cuda.memory_stats(d) for d in self.devices if d < count}
        stats = {d: cuda.memory_stats(d) for d in range(count)}
        if self.devices == "all":
            return stats
        current = int(cuda.current_device())
        return {d: s for d, s in stats.items()
                if d == current or float(s.get(STAT_KEYS["reserved_bytes"], 0) or 0) > 0}

    def collect(self) -> dict[Table, dict[str, list[Any]]]:
        """One row per sampled device; ``{}`` when unavailable or CUDA is not initialised yet."""
        cuda = self._cuda
        if cuda is None:
            return {}
        if not cuda.is_initialized():
            self.state = "not_initialized"
            return {}
        try:
            ts = encode_ts(self._clock.now_ns())
            rows = [{"ts": ts, "host": self.host, "gpu": device, "pid": self.pid, **sample_values(stats)}
                    for device, stats in self._device_stats(cuda).items()]
        except RuntimeError as exc:  # a CUDA error (device lost): report it, keep sampling
            self.state, self.reason = "error", str(exc).splitlines()[0] if str(exc) else "CUDA error"
            log.warning("torch_allocator: %s", self.reason)
            return {}
        self.state = "ok"
        return {ALLOCATOR_SAMPLES: ALLOCATOR_SAMPLES.columns_of(rows)} if rows else {}

    def close(self) -> None:
        self.state = "stopped"


def create(config: dict[str, Any], context: Context) -> TorchAllocatorCollector:
    """``triscope run`` entry point (``[run] collectors = ["torch_allocator"]``); rows go back through collect()."""
    return TorchAllocatorCollector(TorchAllocatorConfig.from_config(config))


class AllocatorHook:
    """A background thread sampling a :class:`TorchAllocatorCollector` into a writer; see :func:`install`."""

    def __init__(self, collector: TorchAllocatorCollector, writer: Any, owns_writer: bool) -> None:
        self.collector, self.writer, self.owns_writer = collector, writer, owns_writer
        self.rows = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="triscope-torch-allocator", daemon=True)
        self._closed = False
        self._lock = threading.Lock()

    def _sample(self) -> None:
        for table, columns in self.collector.collect().items():
            self.rows += self.writer.submit(table, columns)

    def _run(self) -> None:
        deadline = time.monotonic()
        while not self._stop.is_set():
            try:
                self._sample()
            except TriscopeError as exc:
                log.warning("torch_allocator: %s", exc)
            deadline = max(deadline + self.collector.interval_s, time.monotonic())
            self._stop.wait(deadline - time.monotonic())

    @property
    def state(self) -> str:
        return self.collector.state

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop sampling (one last sample), and close the writer when install() opened it.

        Returns True when every row reached the store (always True for a caller's writer: its
        owner flushes it). Safe to call twice."""
        with self._lock:
            if self._closed:
                return True
            self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        try:
            self._sample()
        except TriscopeError as exc:
            log.warning("torch_allocator: %s", exc)
        self.collector.close()
        atexit.unregister(self.close)
        return self.writer.close(timeout_s=timeout_s) if self.owns_writer else True


def install(target: Any, interval_s: float = 0.2, *, host: str = "", devices: str | list[int] = "used",
            spool_dir: str | None = None, cuda: Any = None) -> AllocatorHook:
    """Sample this process's CUDA allocator every ``interval_s`` in a background thread.

    ``target`` is a :class:`triscope.writer.Writer` (rows are submitted to it; its owner closes
    it), a :class:`triscope.store.base.Store` or a config mapping (``[store]``/``[writer]``
    sections): then a writer is opened on ``spool_dir`` (default ``[writer] spool_dir``, or a
    per-process folder under the temp dir for a Store) and closed by ``handle.close()``, which
    also runs at interpreter exit. Without CUDA the hook runs in state ``unavailable`` and writes
    nothing."""
    from triscope.store.base import Store
    from triscope.writer import Writer

    config = {"torch_allocator": {"interval_s": interval_s, "host": host, "devices": devices}}
    collector = TorchAllocatorCollector(config, cuda=cuda)
    if isinstance(target, Writer):
        writer, owns = target, False
    elif isinstance(target, Store):
        spool = spool_dir or os.path.join(tempfile.gettempdir(), f"triscope-spool-torch-allocator-{os.getpid()}")
        writer, owns = Writer(target, spool), True
    elif isinstance(target, Mapping):
        from triscope.store import open_store

        wcfg = dict(target.get("writer") or {})
        if spool_dir:
            wcfg["spool_dir"] = spool_dir
        writer, owns = Writer.from_config({**target, "writer": wcfg}, lambda: open_store(target)), True
    else:
        raise ConfigError(f"torch_allocator.install: need a Writer, Store or config mapping, not "
                          f"{type(target).__name__}")
    collector.start()
    if owns:
        writer.start()
    hook = AllocatorHook(collector, writer, owns)
    if collector.state != "unavailable":
        hook._thread.start()
    atexit.register(hook.close)
    return hook
