"""Simulated fleet parts for the demo, the benchmarks and the tests: vLLM-style backends with a
KV cache, their Prometheus metrics, and a stand-in for NVML where no GPU is present.

Never imported by the store, schema or writer; product code outside demo commands does not
depend on it.
"""
