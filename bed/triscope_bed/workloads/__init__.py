"""What the benches send: arrival schedules, named workloads, the open-loop load generator, the vLLM client."""
