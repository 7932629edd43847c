"""Benchmarks: ``dsv4-bench serve`` (the gateway under load) and ``dsv4-bench engine`` (the model
step against the hardware limit), plus the one-off scripts ``bench_*.py``."""
