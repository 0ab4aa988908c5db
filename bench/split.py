"""Sampler ranks beside trainer ranks (issue 34): what publication costs, and an RL step
split against colocated.

1. Publication (`publication`): 2 ranks under torch's launcher, rank 0 a trainer engine
   behind `SplitEngine`, rank 1 a sampler rank (`SamplerRank`, a whole copy of the base).
   For LoRA ranks 8 and 64 on every linear layer of the tiny model, it times a
   publication (`publish_inflight`) followed by prompt logprobs gated on the new version,
   against the logprobs alone (medians of `repeats`): the difference is what publishing
   costs until the version is live on the sampler rank. Bytes are the adapter's tensors,
   beside the base's parameter bytes, which never travel.
2. RL step (`rl_step`): a server of `ranks` ranks, split (`--sampler-ranks 1`) and
   colocated (every rank trains and samples), each driven by the tinker_compat client
   through the same loop: sample 4 prompts x 4 samples x 32 tokens on the current
   weights while forward_backward + optim_step run on the previous rollouts, then
   `save_weights_for_sampler`. Seconds per step, median of `steps` after one warm-up.
   On CPU the ranks share the machine's cores; `bench.gpu` runs the same rows with a
   GPU per rank where it finds 2 or more.

Run: `.venv/bin/python -m bench.split` (`--only publication` or `--only rl`);
`bench.distributed` prints the publication table too.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PUBLICATION_RANKS = (8, 64)
RL_PROMPTS, RL_SAMPLES, RL_TOKENS = 4, 4, 32


def publication_worker(repeats: int) -> None:
    """One rank of the publication run (rank 1 serves as the sampler rank)."""
    import numpy as np
    import torch

    from twinkle_server.engine.engine import Engine
    from twinkle_server.engine.parallel import Parallel, placement_from_env
    from twinkle_server.engine.types import LoraSpec
    from twinkle_server.ranks.channel import Channel
    from twinkle_server.ranks.sampler_rank import Link, SamplerRank
    from twinkle_server.ranks.split import SplitEngine

    torch.manual_seed(0)
    parallel = Parallel.init(placement_from_env("cpu"), 120)
    link = Link(1, Channel.subgroup((0, 1), 120), Channel.subgroup((0, 1), 120))
    engine = Engine.load("tiny", device="cpu")
    if parallel.rank == 1:
        SamplerRank(engine, link, 120).serve()
        parallel.close()
        return
    split = SplitEngine(engine, [link], 120)
    base_bytes = sum(p.numel() * p.element_size() for p in engine.base.model.parameters())
    prompt = np.arange(5, 69, dtype=np.int64)
    rows = []
    for rank in PUBLICATION_RANKS:
        name = f"r{rank}"
        engine.add_adapter(name, LoraSpec(rank=rank, alpha=2.0 * rank, seed=0))
        key = split.publish_inflight(name)
        round_trips, alone = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            key = split.publish_inflight(name)
            split.compute_logprobs(key, None, prompt)
            round_trips.append(time.perf_counter() - start)
            start = time.perf_counter()
            split.compute_logprobs(key, None, prompt)
            alone.append(time.perf_counter() - start)
        rows.append({"rank": rank, "bytes": split.publish_stats.bytes
                     // split.publish_stats.publications,
                     "round_trip_ms": 1e3 * statistics.median(round_trips),
                     "logprobs_ms": 1e3 * statistics.median(alone),
                     "base_bytes": base_bytes})
        engine.remove_adapter(name)
        split.publish_stats.bytes = split.publish_stats.publications = 0
    split.close()
    parallel.close()
    os.write(1, (json.dumps(rows) + "\n").encode())


def publication(repeats: int = 20) -> None:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "bench.split", "--worker",
                          "--repeats", str(repeats)], check=True, capture_output=True,
                         text=True)
    rows = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("[")))
    print(f"publication: adapter weights from a trainer rank to a sampler rank in memory "
          f"(gloo, CPU), tiny model, LoRA on every linear layer; median of {repeats}")
    print(f"  {'LoRA rank':>9}{'bytes':>12}{'of base':>9}{'publish+logprobs ms':>21}"
          f"{'logprobs ms':>13}{'publication ms':>16}")
    for row in rows:
        print(f"  {row['rank']:>9}{row['bytes']:>12}{row['bytes'] / row['base_bytes']:>8.1%}"
              f"{row['round_trip_ms']:>21.2f}{row['logprobs_ms']:>13.2f}"
              f"{row['round_trip_ms'] - row['logprobs_ms']:>16.2f}")
    print("  publish+logprobs: publish_inflight on rank 0, then 64-token prompt logprobs "
          "gated on that version\n  (so the version is live on the sampler rank); "
          "publication: the difference. The base's weights\n  never travel.")


def _rl_steps(address: str, steps: int) -> list[float]:
    """Seconds per RL step through the tinker_compat client (see the module docstring)."""
    import numpy as np
    from tinker import types

    from tinker_compat import ServiceClient

    rng = np.random.default_rng(0)
    service = ServiceClient(base_url=f"http://{address}")
    try:
        training = service.create_lora_training_client(base_model="tiny", rank=16,
                                                       seed=0).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=RL_TOKENS, temperature=1.0, stop=[])
        rollouts = None
        times = []
        for step in range(steps + 1):
            start = time.perf_counter()
            prompts = [types.ModelInput.from_ints(rng.integers(3, 200, 24).tolist())
                       for _ in range(RL_PROMPTS)]
            sampled = [sampler.sample(p, RL_SAMPLES, params) for p in prompts]
            if rollouts is not None:
                training.forward_backward(rollouts, "cross_entropy").result()
                training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            rollouts = []
            for prompt, future in zip(prompts, sampled, strict=True):
                for sequence in future.result().sequences:
                    ids = prompt.to_ints() + list(sequence.tokens)
                    rollouts.append(types.Datum(
                        model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": np.asarray(ids[1:]),
                                        "weights": np.ones(len(ids) - 1, np.float32)}))
            sampler = training.save_weights_and_get_sampling_client().result()
            if step:
                times.append(time.perf_counter() - start)
        return times
    finally:
        service.close()


def rl_step(ranks: int = 2, device: str = "cpu", steps: int = 5) -> dict[str, float]:
    """Median seconds per RL step, split and colocated, on `ranks` ranks of `device`."""
    from twinkle_server.process import start_server

    layouts = {"colocated": (), "split, 1 sampler rank": ("--sampler-ranks", "1")}
    found = {}
    for label, flags in layouts.items():
        with tempfile.TemporaryDirectory() as data:
            server = start_server(Path(data), "--nproc-per-node", str(ranks), "--device",
                                  device, "--kv-pool-tokens", "16384", *flags)
            try:
                found[label] = statistics.median(_rl_steps(server.address, steps))
            finally:
                server.stop()
    return found


def print_rl_step(ranks: int = 2, device: str = "cpu", steps: int = 5) -> None:
    found = rl_step(ranks, device, steps)
    print(f"RL step on {ranks} ranks ({device}): sample {RL_PROMPTS} x {RL_SAMPLES} x "
          f"{RL_TOKENS} on the current weights while forward_backward + optim_step run on "
          f"the last rollouts, then save_weights_for_sampler; median of {steps}")
    colocated = found["colocated"]
    for label, seconds in found.items():
        print(f"  {label:<24}{seconds:>8.3f} s{colocated / seconds:>7.2f}x")


def main(only: str = "") -> None:
    if only in ("", "publication"):
        publication()
    if only in ("", "rl"):
        print_rl_step()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="sampler ranks: publication, RL step")
    parser.add_argument("--worker", action="store_true", help="one rank of the publication run")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", choices=("publication", "rl"), default="")
    args = parser.parse_args()
    if args.worker:
        publication_worker(args.repeats)
    else:
        main(args.only)
