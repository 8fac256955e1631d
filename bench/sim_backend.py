"""Simulated GPU inference backends for the closed-loop bench (no GPU needed).

    .venv/bin/python bench/sim_backend.py --backend b0:18001:40:16:1.0 --backend b1:18002:20:16:0.5

(``name:port:kv_gib:slots:speed``); prints one JSON line when all ports are listening. The
simulator is :mod:`triscope_bed.engines.backend` (``python -m triscope_bed.engines.backend`` is the same).
"""

from __future__ import annotations

import sys

from triscope_bed.engines.backend import main

if __name__ == "__main__":
    sys.exit(main())
