"""The peers triscope is measured against (HAProxy, nginx, sglang-router, the Gateway API inference
extension's endpoint picker) run as real processes, and the parsers of their logs."""
