"""Soak: 32 concurrent clients on 8 tenants against one server, checked and timed.

Run: `make soak` (or `.venv/bin/python -m bench.soak --clients 32 --tenants 8 --steps 10`).

Every client is its own `tinker_compat.ServiceClient` (own session) with its own LoRA
model, and runs a pipelined loop: each step submits forward_backward + optim_step before
waiting, and every few steps samples from its live weights. When all are done, each
model's weights are compared with a sequential reference: the same seed and data trained
alone on the same server afterwards. The run fails (exit 1) on any error or any mismatch;
it prints op latency p50/p99 and aggregate training tokens/s. Bounded: a fixed number of
steps, and a deadline after which it stops waiting and reports the failure.

`--max-adapters 4` with `--clients 64` is more live runs than resident slots (issue 46):
every run pages out and in between its ops, and must still equal its reference; add
`--adapter-host-memory-gib 0.001` to page them to disk.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tinker import types

from bench.server import _data
from bench.tinker_compat import _tinker_data
from tinker_compat import RestClient, ServiceClient
from twinkle_server.process import start_server

SEQ_TOKENS = 32
DATUMS_PER_STEP = 2
DEADLINE_S = 900
VOCAB = 4096  # the tiny model's


def _train(base_url: str, key: str, seed: int, steps: int, latencies: list[float],
           sample_every: int) -> tuple[ServiceClient, str]:
    """One client's pipelined loop; returns its (open) client and final weights' path."""
    service = ServiceClient(base_url=base_url, api_key=key)
    client = service.create_lora_training_client("tiny", rank=4, seed=seed).result()
    adam = types.AdamParams(learning_rate=1e-2)
    data = _tinker_data(_data(DATUMS_PER_STEP, SEQ_TOKENS, VOCAB, seed))

    def timed(future) -> None:
        start = time.perf_counter()
        future.future().add_done_callback(
            lambda _: latencies.append(time.perf_counter() - start))

    pending = []
    for step in range(steps):
        pending += [client.forward_backward(data, "cross_entropy"), client.optim_step(adam)]
        for future in pending[-2:]:
            timed(future)
        if sample_every and step % sample_every == sample_every - 1:
            sampler = client.save_weights_and_get_sampling_client().result()
            sampled = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2,
                                     types.SamplingParams(max_tokens=8, seed=seed))
            timed(sampled)
            pending.append(sampled)
    for future in pending:
        future.result()
    path = client.save_weights_for_sampler("final").result().path
    return service, path


def _weights(base_url: str, key: str, path: str, dest: Path) -> dict[str, np.ndarray]:
    folder = RestClient(base_url=base_url, api_key=key).download_checkpoint(path, dest).result()
    return load_file(str(Path(folder) / "adapter_model.safetensors"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sample-every", type=int, default=5)
    parser.add_argument("--max-adapters", type=int, default=None,
                        help="resident adapter slots (default: one for every model the run "
                             "makes); fewer pages the idle ones out (engine.residency)")
    parser.add_argument("--adapter-host-memory-gib", type=float, default=None,
                        help="host memory for paged-out adapters; past it they go to disk")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="twinkle-soak-") as tmp:
        data_dir = Path(tmp) / "data"
        keys = []
        for t in range(args.tenants):
            out = subprocess.run([sys.executable, "-m", "twinkle_server.cli", "keys", "create",
                                  "--tenant", f"tenant{t}", "--data-dir", str(data_dir)],
                                 capture_output=True, text=True, check=True)
            keys.append(out.stdout.strip().splitlines()[-1])
        per_tenant = -(-args.clients // args.tenants)
        slots = args.max_adapters or 2 * args.clients + 8
        spill = () if args.adapter_host_memory_gib is None else (
            "--adapter-host-memory-gib", str(args.adapter_host_memory_gib))
        server = start_server(data_dir, "--max-adapters", str(slots),
                              "--max-adapters-per-tenant", str(2 * per_tenant + 2), *spill)
        base_url = f"http://{server.address}"
        latencies: list[float] = []
        results: dict[int, tuple] = {}
        failures: list[str] = []

        def run(i: int) -> None:
            try:
                results[i] = _train(base_url, keys[i % args.tenants], i, args.steps, latencies,
                                    args.sample_every)
            except Exception as exc:  # noqa: BLE001 - every failure is reported below
                failures.append(f"client {i}: {type(exc).__name__}: {exc}")

        try:
            start = time.perf_counter()
            threads = [threading.Thread(target=run, args=(i,)) for i in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(1.0, DEADLINE_S - (time.perf_counter() - start)))
            wall = time.perf_counter() - start
            if any(t.is_alive() for t in threads):
                failures.append(f"clients still running after the {DEADLINE_S}s deadline")
            mismatches = 0
            for i, (service, path) in sorted(results.items()):
                reference, ref_path = _train(base_url, keys[i % args.tenants], i, args.steps,
                                             [], 0)
                key = keys[i % args.tenants]
                got = _weights(base_url, key, path, Path(tmp) / f"got{i}")
                want = _weights(base_url, key, ref_path, Path(tmp) / f"want{i}")
                reference.close()
                diff = max(float(np.abs(got[k] - want[k]).max()) for k in want)
                mismatches += diff > 1e-5
                service.close()
        finally:
            server.stop()

    tokens = args.clients * args.steps * DATUMS_PER_STEP * SEQ_TOKENS
    lat = np.sort(np.asarray(latencies)) * 1000 if latencies else np.zeros(1)
    print(f"{args.clients} clients on {args.tenants} tenants, {args.steps} pipelined steps "
          f"each (forward_backward + optim_step, {DATUMS_PER_STEP} x {SEQ_TOKENS} tokens), "
          f"sampling every {args.sample_every} steps, {slots} resident adapter slots")
    print("| errors | weights != sequential reference | ops | op latency p50 | p99 | "
          "training tokens/s | wall |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {len(failures)} | {mismatches} of {len(results)} | {len(latencies)} | "
          f"{np.percentile(lat, 50):.0f} ms | {np.percentile(lat, 99):.0f} ms | "
          f"{tokens / wall:.0f} | {wall:.1f} s |")
    for failure in failures[:10]:
        print(failure)
    return 1 if failures or mismatches or len(results) != args.clients else 0


if __name__ == "__main__":
    sys.exit(main())
