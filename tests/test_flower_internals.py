"""Flower internals sky-flower depends on: these fail loudly when a Flower upgrade moves them."""

from concurrent.futures import ThreadPoolExecutor

from flwr.server.superlink.fleet.vce import vce_api

from sky_flower.jobs.hermes import concurrent_messages, flower_pool_unpatchable


def test_installed_flower_still_has_the_worker_pool_the_hermes_job_widens() -> None:
    # If this fails after a Flower upgrade: read vce_api.run_api, then either extend
    # PATCHED_FLOWER (the bare ThreadPoolExecutor() is still there) or use Flower's new
    # setting for concurrent message workers, and update docs/hermes.md.
    assert flower_pool_unpatchable() is None


def test_concurrent_messages_widens_the_pool_and_restores_it() -> None:
    original = vce_api.ThreadPoolExecutor
    with concurrent_messages(40):
        pool = vce_api.ThreadPoolExecutor()
        try:
            assert pool._max_workers == 40
        finally:
            pool.shutdown()
    assert vce_api.ThreadPoolExecutor is original is ThreadPoolExecutor
