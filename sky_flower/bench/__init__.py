"""Benchmarks that print figures (``python -m sky_flower.bench.<name>``: ``planner``,
``federated``, ``decentralized``); not tests."""
