"""Benchmark support: synthetic routed workloads, timing, result rows."""
