"""chDB's engine module, loaded once per process, optionally in the background while the CLI starts.

``import chdb`` costs a CLI command about 0.2 s before its first query: the 550 MB engine library is
mapped and initialised, and the package's ``__init__`` then opens an in-memory connection to read the
engine's version (and imports ``importlib.metadata``). triscope needs only the engine's C-level module,
``chdb._chdb``. :func:`start_loading` loads it on a worker thread, whose ``dlopen`` of the library
(which does not hold the GIL) runs in parallel with the command's own imports; the engine's global
start-up then happens at the store's first connection. The package's
``__init__`` is not run there: it changes the process's working directory while it imports, which
would move relative paths under the main thread's feet.

If the engine cannot be loaded that way (another chDB layout), :func:`engine` falls back to
``import chdb``; ``import chdb`` later in the process reuses the module loaded here.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

_RTLD_DEEPBIND = 0x8
"""As chDB's own preload: the engine's symbols (its jemalloc, its Arrow) resolve inside the engine."""

MODULE = "chdb._chdb"

_lock = threading.Lock()
_loader: threading.Thread | None = None
_loaded: ModuleType | None = None


def start_loading() -> None:
    """Begin loading the engine on a worker thread (idempotent; a no-op once loaded)."""
    global _loader
    with _lock:
        if _loader is not None or _loaded is not None or MODULE in sys.modules:
            return
        # Not a daemon: an interpreter exiting mid-dlopen would tear the engine down under it.
        _loader = threading.Thread(target=_load_into_state, name="triscope-chdb-load")
        _loader.start()


def engine() -> ModuleType:
    """The loaded ``chdb._chdb`` module (waits for :func:`start_loading`'s thread, or loads it now)."""
    if _loader is not None:
        _loader.join()
    with _lock:
        if _loaded is None:
            _load_into_state_locked()
        assert _loaded is not None
        return _loaded


def _load_into_state() -> None:
    with _lock:
        _load_into_state_locked()


def _load_into_state_locked() -> None:
    global _loaded
    if _loaded is not None:
        return
    loaded = sys.modules.get(MODULE)
    if loaded is None:
        try:
            loaded = _load_engine_only()
        except Exception:  # any other layout: chDB's own import path below
            loaded = None
    if loaded is None:
        import chdb

        loaded = chdb._chdb
    _loaded = loaded


def _load_engine_only() -> ModuleType | None:
    """Load ``chdb/_chdb.abi3.so`` as ``chdb._chdb`` (None when this chDB has no such file)."""
    spec = importlib.util.find_spec("chdb")
    locations = list(spec.submodule_search_locations or []) if spec else []
    library = next((Path(p) / "_chdb.abi3.so" for p in locations if (Path(p) / "_chdb.abi3.so").is_file()), None)
    if library is None:
        return None
    ctypes.CDLL(str(library), mode=sys.getdlopenflags() | _RTLD_DEEPBIND)
    module_spec = importlib.util.spec_from_file_location(MODULE, library)
    if module_spec is None or module_spec.loader is None:
        return None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    sys.modules.setdefault(MODULE, module)
    return sys.modules[MODULE]
