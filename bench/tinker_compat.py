"""Tinker shim benchmarks over loopback gRPC.

Run: `.venv/bin/python -m bench.tinker_compat` (also part of `make bench`).

1. forward_backward + optim_step, 8 x 256 tokens, through `tinker_compat` against a real
   server process vs the in-process engine in this process (same model, adapter shape,
   data): the shim's whole cost (tinker.types encode, futures, gRPC, decode) as a ratio.
2. 20 forward_backward + optim_step pairs: waiting on each future before the next call
   vs submitting all 40 ops before waiting on any (seq ids keep them in order).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from tinker import types

from bench.server import _data, print_overhead
from tinker_compat import ServiceClient
from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.types import AdamParams, Datum, LoraSpec, LossSpec
from twinkle_server.process import start_server

PAIRS = 20


def _tinker_data(batch) -> list[types.Datum]:
    return [types.Datum(model_input=types.ModelInput.from_ints(ids.tolist()),
                        loss_fn_inputs=inputs) for ids, inputs in batch]


def main() -> None:
    engine = Engine.load("tiny")
    batch = _data(8, 256, engine.base.vocab_size)
    engine.add_adapter("local", LoraSpec.from_tinker(rank=4, seed=0))
    datums = [Datum(ids, inputs) for ids, inputs in batch]
    data = _tinker_data(batch)
    adam = types.AdamParams(learning_rate=1e-2, eps=1e-8)

    def local_step() -> None:
        engine.forward_batch([ForwardRequest("local", datums, LossSpec("cross_entropy"), True)])
        engine.optim_step("local", AdamParams(learning_rate=1e-2, eps=1e-8))

    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp))
        try:
            service_client = ServiceClient(base_url=f"http://{server.address}")
            training_client = service_client.create_lora_training_client(
                "tiny", rank=4, seed=0).result()

            def shim_step() -> None:
                fwdbwd = training_client.forward_backward(data, "cross_entropy")
                optim = training_client.optim_step(adam)
                fwdbwd.result()
                optim.result()

            print_overhead("shim overhead: forward_backward + optim_step, 8 x 256 tokens",
                           local_step, "tinker_compat", shim_step, 8 * 256, "tinker_compat")

            small = _tinker_data(_data(2, 64, engine.base.vocab_size, seed=1))
            print(f"{PAIRS} x (forward_backward + optim_step), 2 x 64 tokens:")
            for mode in ("waited", "pipelined", "waited", "pipelined"):
                start = time.perf_counter()
                futures = []
                for _ in range(PAIRS):
                    pair = (training_client.forward_backward(small, "cross_entropy"),
                            training_client.optim_step(adam))
                    if mode == "waited":
                        [future.result() for future in pair]
                    futures.extend(pair)
                [future.result() for future in futures]
                print(f"  {mode:<10}{time.perf_counter() - start:>8.3f} s")
            service_client.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
