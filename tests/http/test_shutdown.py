"""SIGTERM with samples in flight over HTTP (issue 45): the server ends every sample at
once, answers each client still polling with UNAVAILABLE naming the shutdown before its
HTTP front stops, lets training ops queued before the signal finish, and exits 0 well
within its drain bound. Before: it decoded abandoned samples for the whole 60 s drain,
and a polling client never got its answer (the front refused it while draining)."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
import tinker
from tinker import types

from twinkle_server.process import start_server

from ..service.harness import create_key

pytestmark = pytest.mark.integration
ENDLESS = types.SamplingParams(max_tokens=4000, stop=[], seed=3, temperature=1.0)
EXIT_WITHIN_SECONDS = 30
"""Well under the 60 s drain bound (`server.DRAIN_SECONDS`), which a server decoding its
samples to their end would reach: 4000 tokens a sample."""


def test_sigterm_answers_polling_samples_unavailable_and_exits_promptly(tmp_path, tiny_cache):
    key = create_key(tmp_path / "data", "alice")
    proc = start_server(tmp_path / "data", http=True)
    client = tinker.ServiceClient(base_url=f"http://{proc.http_address}", api_key=key)
    try:
        sampler = client.create_sampling_client(base_model="tiny").result()
        futures = [sampler.sample(types.ModelInput.from_ints([5, 6, 7, 8 + i]), 1, ENDLESS)
                   for i in range(3)]
        training = client.create_lora_training_client(base_model="tiny", rank=4).result()
        ids = list(range(3, 20))
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": np.asarray(ids[1:]),
                                            "weights": np.ones(len(ids) - 1, np.float32)})
        assert np.isfinite(training.forward_backward([datum], "cross_entropy").result()
                           .metrics["loss:sum"])
        outcomes: list[str] = []

        def wait(future) -> None:
            try:
                future.result(timeout=EXIT_WITHIN_SECONDS)
                outcomes.append("finished")
            except Exception as exc:   # noqa: BLE001 - the outcome is what is asserted
                outcomes.append(f"{type(exc).__name__}: {exc}")

        waiters = [threading.Thread(target=wait, args=(f,)) for f in futures]
        for waiter in waiters:
            waiter.start()
        started = time.monotonic()
        code = proc.stop(signal.SIGTERM, timeout=EXIT_WITHIN_SECONDS + 60)
        took = time.monotonic() - started
        for waiter in waiters:
            waiter.join(EXIT_WITHIN_SECONDS)
        assert code == 0, proc.log()[-3000:]
        assert took < EXIT_WITHIN_SECONDS, took
        assert len(outcomes) == 3
        for outcome in outcomes:
            assert "shutting down" in outcome and "sample was stopped" in outcome, outcomes
    finally:
        proc.stop(signal.SIGKILL)
