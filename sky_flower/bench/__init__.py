"""Benchmarks that print figures (``python -m sky_flower.bench.<name>``); not tests."""
