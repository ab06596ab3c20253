"""Benchmarks that write JSON results: throughput (offline), and more under `tokenmill bench`."""
