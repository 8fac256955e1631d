"""Join test bed runs of the same arrivals, made one policy at a time, into one table and PNG.

    .venv/bin/python bench/testbed_merge.py lc.json epp.json=new-defaults gie.json --out var/merged.json

The code lives in :mod:`triscope_bed.reports.testbed_merge` (docs/closed_loop.md).
"""

from __future__ import annotations

import sys

from triscope_bed.reports.testbed_merge import main

if __name__ == "__main__":
    sys.exit(main())
