"""Benchmarks that print figures (``python -m sky_flower.bench.<name>``: ``planner``,
``decentralized``); not tests."""
