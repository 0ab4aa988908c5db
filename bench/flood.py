"""One tenant's flood against another tenant's latency and the server's memory, through
the stock `tinker` SDK over HTTP (the back-pressure bounds of `scheduling.queues`).

Bob runs forward_backward ops one at a time (8 datums of 32 tokens), first alone, then
while alice's client pipelines `--flood` of the same ops without waiting. Printed per
bound on alice's queue (`--max-queued-ops-per-tenant`; the default's and a tight one):
bob's op latency p50 / p95 alone and under the flood (the scheduler's rotation gives him
a turn at every pass, and a merged pass takes his op beside alice's), how many of
alice's ops were refused (429) and sent again by the SDK, how long her flood took to
drain, and the server's resident memory before and at its peak (its process and its
children, sampled every 50 ms).

Run: `.venv/bin/python -m bench.flood` (add `--flood 400` for the issue's figure). Figures
measure and print; nothing passes or fails on time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import tinker
from tinker import types

from twinkle_server.process import start_server

DATUMS, TOKENS, BOB_OPS = 8, 32, 20


def _data(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(DATUMS):
        ids = rng.integers(3, 4000, TOKENS + 1)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
                                loss_fn_inputs={"target_tokens": ids[1:],
                                                "weights": np.ones(TOKENS, np.float32)}))
    return data


def _rss(pid: int) -> int:
    """Resident bytes of `pid` and its children."""
    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return 0


def _bob(training, data) -> list[float]:
    latencies = []
    for _ in range(BOB_OPS):
        start = time.perf_counter()
        training.forward_backward(data, "cross_entropy").result()
        latencies.append(time.perf_counter() - start)
    return latencies


def _refused(url: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics").text
               .splitlines() if line.startswith("twinkle_ops_total{")
               and 'outcome="resource_exhausted"' in line)


def measure(bound: int | None, flood: int) -> dict[str, float]:
    """One server (`bound` on alice's queue; None: the default), bob alone, then bob
    under alice's flood."""
    with tempfile.TemporaryDirectory(prefix="twinkle-flood-") as tmp:
        data_dir = Path(tmp)
        keys = {}
        for tenant in ("alice", "bob"):
            out = subprocess.run([sys.executable, "-m", "twinkle_server.cli", "keys",
                                  "create", "--tenant", tenant, "--data-dir", str(data_dir)],
                                 capture_output=True, text=True, check=True)
            keys[tenant] = out.stdout.strip().splitlines()[-1]
        flags = () if bound is None else ("--max-queued-ops-per-tenant", str(bound))
        server = start_server(data_dir, *flags, http=True)
        url = f"http://{server.http_address}"
        try:
            alice = tinker.ServiceClient(base_url=url, api_key=keys["alice"])
            bob = tinker.ServiceClient(base_url=url, api_key=keys["bob"])
            a_model = alice.create_lora_training_client(base_model="tiny", rank=4).result()
            b_model = bob.create_lora_training_client(base_model="tiny", rank=4).result()
            a_data, b_data = _data(1), _data(2)
            _bob(b_model, b_data)                          # warm both paths
            a_model.forward_backward(a_data, "cross_entropy").result()
            alone = _bob(b_model, b_data)
            before, peak, done = _rss(server.proc.pid), 0, threading.Event()

            def sample_memory() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, _rss(server.proc.pid))
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample_memory)
            sampler.start()
            start = time.perf_counter()
            futures = [a_model.forward_backward(a_data, "cross_entropy")
                       for _ in range(flood)]
            flooded = _bob(b_model, b_data)
            for future in futures:
                future.result()
            drained = time.perf_counter() - start
            done.set()
            sampler.join()
            refused = _refused(url)
            alice.close("success").result()
            bob.close("success").result()
        finally:
            server.stop()
    return {"alone_p50": statistics.median(alone), "alone_p95": _p95(alone),
            "flood_p50": statistics.median(flooded), "flood_p95": _p95(flooded),
            "refused": refused, "drained": drained, "before": before, "peak": peak}


def _p95(values: list[float]) -> float:
    return float(np.percentile(values, 95))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=200,
                        help="forward_backward ops alice pipelines")
    parser.add_argument("--tight", type=int, default=16,
                        help="the tight bound on alice's queued ops")
    args = parser.parse_args(argv)
    print(f"bob: {BOB_OPS} forward_backward of {DATUMS} x {TOKENS} tokens, one at a time; "
          f"alice pipelines {args.flood} of the same")
    print("| alice's bound | bob alone p50 / p95 | bob under the flood p50 / p95 | "
          "alice's 429s | flood drained | server memory before -> peak |")
    print("|---|---|---|---|---|---|")
    for bound in (None, args.tight):
        m = measure(bound, args.flood)
        name = "default (1024)" if bound is None else str(bound)
        print(f"| {name} | {m['alone_p50'] * 1e3:.0f} / {m['alone_p95'] * 1e3:.0f} ms | "
              f"{m['flood_p50'] * 1e3:.0f} / {m['flood_p95'] * 1e3:.0f} ms | "
              f"{m['refused']:.0f} | {m['drained']:.1f} s | "
              f"{m['before'] / 2**20:.0f} -> {m['peak'] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
