"""Conversations in the decode pool, with and without the prefix cache, on each layer kind
the pool holds (issue 45): full attention, sliding windows, a hybrid's recurrent states.

Each conversation's turn is its last turn's prompt and completion plus new tokens (a
chat's next user message), so its prefix is cached (a session per conversation: the
pool's `prefix_cache`) or computed again (no session). Conversations start from a
`--prompt`-token prompt and each turn adds `--reply` sampled tokens and `--ask` new ones;
`--conversations` of them take their turns together (each turn's requests submitted at
once, the next turn after all are answered). The bases are bench.limit's wide random
Qwen3 (hidden 512, 8 layers), the same with a sliding window of 128 on every other layer
(as gpt-oss), and the random Qwen3.5 text hybrid of those sizes (6 Gated DeltaNet layers,
2 full attention), each with one rank-16 adapter on every linear layer, trained a step
and sampled as an inflight publication (Tinker's sampling client of live weights).
The two arms run on one engine, rounds interleaved (either first in turn), with fresh
conversations each round; printed: the median seconds of a round, its prompt tokens
computed and reused (the pool's counters), and the ratio. A hybrid's or a window's cached
prefix is reused only whole, which the next turn of a conversation is, and its prefill
joins only joiners of as many new tokens: `--varied` gives each conversation its own
number of asked tokens, so that those turns prefill one by one.

Run: `.venv/bin/python -m bench.turns` (about seven minutes on 2 CPU cores; also part of
`make bench`). Figures measure and print; nothing passes or fails on time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.limit import ADAPTER, _engine
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.types import SampleRequest, SamplingParams


def _conversations(engine: Engine, route: str, seed: int, sessions: bool,
                   args: argparse.Namespace) -> tuple[float, int, int]:
    """`args.conversations` conversations of `args.turns` turns on the weights `route`
    names, in sessions or not: seconds, prompt tokens computed and prompt tokens reused."""
    rng = np.random.default_rng(seed)
    vocab = engine.base.vocab_size
    prompts = [rng.integers(3, vocab, args.prompt) for _ in range(args.conversations)]
    asks = (np.linspace(args.ask // 2, args.ask * 3 // 2, args.conversations).astype(int)
            if args.varied else [args.ask] * args.conversations)
    before = engine.decode_stats()
    start = time.perf_counter()
    for turn in range(args.turns):
        requests = [SampleRequest(
            route, None, prompt, 1,
            SamplingParams(max_tokens=args.reply, seed=seed * 1000 + turn * 100 + i,
                           ignore_eos=True),
            cache_namespace=f"round-{seed}-conversation-{i}" if sessions else "")
            for i, prompt in enumerate(prompts)]
        keys = list(range(len(requests)))
        done = dict(engine.decode(requests, keys, 0.5))
        while len(done) < len(requests):
            done.update(engine.decode([], [], 0.5))
        failed = [out for out in done.values() if isinstance(out, Exception)]
        if failed:
            raise failed[0]
        prompts = [np.concatenate([prompt, done[i].sequences[0].tokens,
                                   rng.integers(3, vocab, asks[i])])
                   for i, prompt in enumerate(prompts)]
    seconds = time.perf_counter() - start
    after = engine.decode_stats()
    return (seconds, after.prompt_tokens_computed - before.prompt_tokens_computed,
            after.prefix_hit_tokens - before.prefix_hit_tokens)


def measure(name: str, engine: Engine, args: argparse.Namespace) -> None:
    """One base: both arms' rounds interleaved, then its line. The adapter is sampled as
    an inflight publication, whose weights have a version a session's prefixes are kept
    under (a live adapter's change with every step: it reuses none)."""
    route = engine.publish_inflight(ADAPTER)
    arms: dict[str, bool] = {"computed": False, "reused": True}
    runs: dict[str, list[tuple[float, int, int]]] = {arm: [] for arm in arms}
    for sessions in arms.values():
        _conversations(engine, route, 0, sessions, args)
    for seed in range(1, args.rounds + 1):
        order = list(arms.items())
        for arm, sessions in order if seed % 2 else order[::-1]:
            runs[arm].append(_conversations(engine, route, seed, sessions, args))
    seconds = {arm: statistics.median(run[0] for run in runs[arm]) for arm in arms}
    computed = {arm: runs[arm][-1][1] for arm in arms}
    print(f"  {name:<28}{seconds['computed']:>10.2f}{computed['computed']:>10}"
          f"{seconds['reused']:>10.2f}{computed['reused']:>10}{runs['reused'][-1][2]:>10}"
          f"{seconds['computed'] / seconds['reused']:>8.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--reply", type=int, default=32)
    parser.add_argument("--ask", type=int, default=32)
    parser.add_argument("--varied", action="store_true",
                        help="each conversation asks its own number of tokens, spread over "
                             "ask/2..3 ask/2")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from bench.engine import _hybrid_base, _wider_base, _windowed_base
    from bench.limit import WINDOW

    bases: dict[str, Callable[[str], str]] = {
        "full attention": _wider_base,
        f"sliding window {WINDOW}": lambda out: _windowed_base(out, WINDOW),
        "hybrid (Gated DeltaNet)": _hybrid_base,
    }
    torch.manual_seed(0)
    asked = f"{args.ask // 2}..{args.ask * 3 // 2}" if args.varied else str(args.ask)
    print(f"conversations: {args.conversations} at once, {args.turns} turns, a "
          f"{args.prompt}-token start, each turn +{args.reply} sampled +{asked} asked "
          f"({torch.get_num_threads()} threads, float32, hidden 512, 8 layers, LoRA rank 16 "
          f"all-linear; medians of {args.rounds} interleaved rounds; tokens: a round's "
          "prompt tokens)")
    print(f"  {'base':<28}{'computed s':>10}{'tokens':>10}{'reused s':>10}{'tokens':>10}"
          f"{'cached':>10}{'ratio':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, make) in enumerate(bases.items()):
            measure(name, _engine(make(f"{tmp}/base-{i}")), args)


if __name__ == "__main__":
    main()
