"""Benchmarks of sky-flower (``python -m sky_flower.bench.decentralized``)."""
