"""The stock `tinker` SDK over HTTP vs `tinker_compat` over gRPC vs the engine alone.

Run: `.venv/bin/python -m bench.tinker_http` (also part of `make bench`).

forward_backward + optim_step of 8 x 256 tokens, the same model, adapter shape and data
each way, one server process serving both fronts: each path's best of interleaved
rounds, and its ratio to the engine alone (the HTTP front's whole cost: the SDK's
protobuf body, futures polled with retrieve_future, JSON and protobuf answers).

The engine row runs in its own process (`_engine_worker`), driven over a pipe (a round
trip of ~0.1 ms), not in this one: this process also holds the SDK's event-loop thread,
the gRPC client's threads and both clients' heartbeats, which share its GIL with an
in-process engine and made that row slower than the same step through the server. A
fresh process with torch's default thread count is what the server gets, so
the engine row and the server compute alike; and it sits idle while the client rows
run, as the server sits idle during the engine row.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from bench.server import _data  # noqa: E402
from bench.timing import best_per_call  # noqa: E402
from tinker_compat import ServiceClient  # noqa: E402
from twinkle_server.engine.engine import Engine, ForwardRequest  # noqa: E402
from twinkle_server.engine.types import AdamParams, Datum, LoraSpec, LossSpec  # noqa: E402
from twinkle_server.process import start_server  # noqa: E402

ROUNDS = 8
BATCH, TOKENS = 8, 256


def _engine_worker(conn: Connection) -> None:
    """The engine row's process: load the engine, send its vocabulary size, then run one
    step per message until the pipe closes."""
    engine = Engine.load("tiny")
    engine.add_adapter("local", LoraSpec.from_tinker(rank=4, seed=0))
    vocab = engine.base.vocab_size
    datums = [Datum(ids, inputs) for ids, inputs in _data(BATCH, TOKENS, vocab)]
    conn.send(vocab)
    while True:
        try:
            conn.recv()
        except EOFError:
            return
        engine.forward_batch([ForwardRequest("local", datums, LossSpec("cross_entropy"), True)])
        engine.optim_step("local", AdamParams(learning_rate=1e-2, eps=1e-8))
        conn.send(None)


def main() -> None:
    conn, child_conn = mp.get_context("spawn").Pipe()
    worker = mp.get_context("spawn").Process(target=_engine_worker, args=(child_conn,),
                                             daemon=True)
    worker.start()
    batch = _data(BATCH, TOKENS, conn.recv())
    data = [types.Datum(model_input=types.ModelInput.from_ints(ids.tolist()),
                        loss_fn_inputs=inputs) for ids, inputs in batch]
    adam = types.AdamParams(learning_rate=1e-2, eps=1e-8)

    def engine_step() -> None:
        conn.send(None)
        conn.recv()

    def client_step(training_client):
        def step() -> None:
            fwdbwd = training_client.forward_backward(data, "cross_entropy")
            optim = training_client.optim_step(adam)
            fwdbwd.result()
            optim.result()
        return step

    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), http=True)
        try:
            http = tinker.ServiceClient(base_url=f"http://{server.http_address}",
                                        api_key="tml-open")
            grpc = ServiceClient(base_url=f"http://{server.address}")
            steps = {
                "engine (own process)": engine_step,
                "tinker_compat over gRPC": client_step(grpc.create_lora_training_client(
                    "tiny", rank=4, seed=0).result()),
                "tinker SDK over HTTP": client_step(http.create_lora_training_client(
                    base_model="tiny", rank=4, seed=0).result()),
            }
            best = best_per_call(steps, ROUNDS, warmup=True)
            base = best["engine (own process)"]
            print(f"forward_backward + optim_step, {BATCH} x {TOKENS} tokens (best of "
                  f"{ROUNDS} interleaved rounds):")
            for name, seconds in best.items():
                print(f"  {name:<26}{seconds * 1000:>9.1f} ms  {seconds / base:>6.2f}x")
            print("  HTTP speed / gRPC speed: "
                  f"{best['tinker_compat over gRPC'] / best['tinker SDK over HTTP']:.2f}x")
            http.close("success").result()
            grpc.close()
        finally:
            server.stop()
            conn.close()
            worker.join(timeout=30)


if __name__ == "__main__":
    main()
