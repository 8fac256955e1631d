"""Closed-loop bench: simulated GPU backends behind real HAProxy, balancing policies compared.

    .venv/bin/python bench/closed_loop.py            # default: 4 policies, one seed, ~3 min on 2 cores
    .venv/bin/python bench/closed_loop.py --repeat 4 # seeds 1-4 pooled (docs/closed_loop.md table), ~12 min
    .venv/bin/python bench/closed_loop.py --steps 8 --step-s 20   # longer
    .venv/bin/python bench/closed_loop.py --json --dump-results out.jsonl

The harness lives in :mod:`triscope_bed.fleet.closed_loop` (the smoke test runs it too); docs/closed_loop.md
describes the policies, the options and the results.
"""

from __future__ import annotations

import sys

from triscope_bed.fleet.closed_loop import main

if __name__ == "__main__":
    sys.exit(main())
