"""The engine on several ranks (issue 16): one training step on the tiny model, per path.

Measures forward_backward + optim_step of 8 x 256 tokens (one adapter, rank 16
all-linear, cross_entropy, fixed seeds) on three paths, each in fresh processes:
the single-process engine (no `Parallel`), 1 rank under torch's launcher, and 2 ranks
(gloo, FSDP2-sharded base). Each rank prints one JSON line: tokens/s (median of the timed
steps after one warm-up step), peak RSS (VmHWM), and the base parameter bytes it holds
at rest. The paths run in interleaved rounds (a loaded 2-core machine slows a 2-thread
process several-fold now and then), and the parent prints each path's best round in one
table, with ratios against the single-process path.

Then the cost of publishing adapter weights to a sampler rank (`bench.split.publication`).

Run: `.venv/bin/python -m bench.distributed` (also part of `make bench`; about 90 s on 2
cores); `--steps N`, `--rounds N`. Every rank makes the same engine calls in the same order.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from bench import split

BATCH, LENGTH = 8, 256


def _peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM, not ru_maxrss, which Linux carries over
    from the parent across fork+exec (the launcher's own RSS would floor it)."""
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def worker(steps: int) -> None:
    """One process's share: load, one warm-up step, `steps` timed steps, one JSON line."""
    import torch

    from bench.data import random_datums
    from twinkle_server.engine.engine import Engine, ForwardRequest
    from twinkle_server.engine.parallel import Parallel, placement_from_env
    from twinkle_server.engine.types import AdamParams, LoraSpec, LossSpec

    torch.manual_seed(0)
    parallel = Parallel.init(placement_from_env("cpu"), 120) if "RANK" in os.environ else None
    engine = Engine.load("tiny", device="cpu", parallel=parallel)
    if parallel is None:
        at_rest = sum(p.numel() * p.element_size() for p in engine.base.model.parameters())
    else:
        at_rest = parallel.local_param_bytes()
    engine.add_adapter("a", LoraSpec(rank=16, alpha=32, seed=0))
    request = ForwardRequest("a", random_datums(BATCH, LENGTH, engine.base.vocab_size),
                             LossSpec("cross_entropy"), True)
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        engine.forward_batch([request])
        engine.optim_step("a", AdamParams(learning_rate=1e-4))
        if step:
            times.append(time.perf_counter() - start)
    line = json.dumps({"rank": parallel.rank if parallel else 0,
                       "threads": torch.get_num_threads(), "at_rest": at_rest,
                       "tokens_s": BATCH * LENGTH / statistics.median(times),
                       "rss": _peak_rss()})
    os.write(1, f"{line}\n".encode())  # one write: ranks share the pipe, lines stay whole
    if parallel is not None:
        parallel.close()


def _run(ranks: int, steps: int) -> list[dict]:
    """Each rank's figures of one path: `ranks` 0 is the single-process engine."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(ranks)] if ranks else [sys.executable]
    out = subprocess.run([*launcher, "-m", "bench.distributed", "--worker", "--steps",
                          str(steps)], check=True, capture_output=True, text=True)
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    return sorted(rows, key=lambda r: r["rank"])


def main(steps: int = 8, rounds: int = 2) -> None:
    paths = {"single process": 0, "torchrun, 1 rank": 1, "torchrun, 2 ranks": 2}
    print(f"distributed: forward_backward + optim_step, {BATCH} x {LENGTH} tokens, rank 16 "
          f"all-linear, tiny model, CPU gloo; median of {steps} steps after 1 warm-up, each "
          f"path's best of {rounds} interleaved rounds")
    best: dict[str, list[dict]] = {}
    for _ in range(rounds):
        for label, ranks in paths.items():
            rows = _run(ranks, steps)
            if label not in best or (min(r["tokens_s"] for r in rows)
                                     > min(r["tokens_s"] for r in best[label])):
                best[label] = rows
    print(f"  {'path':<20}{'rank':>5}{'threads':>8}{'tokens/s':>10}{'ratio':>7}"
          f"{'peak RSS MiB':>14}{'ratio':>7}{'base bytes at rest':>20}{'ratio':>7}")
    one = best["single process"][0]
    for label, rows in best.items():
        for row in rows:
            print(f"  {label:<20}{row['rank']:>5}{row['threads']:>8}{row['tokens_s']:>10.0f}"
                  f"{row['tokens_s'] / one['tokens_s']:>6.2f}x{row['rss'] / 2**20:>14.1f}"
                  f"{row['rss'] / one['rss']:>6.2f}x{row['at_rest']:>20}"
                  f"{row['at_rest'] / one['at_rest']:>6.2f}x")
    print("  ratios: against the single-process path. On a 2-core CPU no speed-up is expected "
          "(two ranks\n  share the two cores and add all-gathers); the point is the path and "
          "the per-rank memory.")
    print()
    split.publication()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="the engine on 1 process, 1 rank, 2 ranks")
    parser.add_argument("--worker", action="store_true", help="run one rank's share")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs per path")
    args = parser.parse_args()
    if args.worker:
        worker(args.steps)
    else:
        main(args.steps, args.rounds)
