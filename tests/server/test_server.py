"""`server.serve`'s own steps, apart from the fronts and the runtime."""

from __future__ import annotations

import asyncio
import threading

from twinkle_server import server
from twinkle_server.config.flags import ServerConfig


def test_the_engines_load_on_a_thread_that_has_ended_when_serving_begins():
    """A thread that ran torch keeps its OpenMP team while it lives; only the compute
    threads' may outlive the load (see `server._load_on_own_thread`)."""
    seen: list[threading.Thread] = []

    def load(config):
        seen.append(threading.current_thread())
        return "engines"

    assert asyncio.run(server._load_on_own_thread(load, ServerConfig())) == "engines"
    assert seen[0] is not threading.main_thread()
    assert not seen[0].is_alive()
