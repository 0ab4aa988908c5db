"""How close the engine runs to this machine's limit (issue 35): each row's model FLOP/s
against the rate this machine multiplies the model's own shapes at, measured in the same
run.

The model is the sampling bench's random Qwen3 (hidden 512, 8 layers, 8 heads, 4 KV
heads, vocabulary 4096: `bench.engine`'s wide base) with one LoRA adapter of rank 16 on
every decoder linear layer (`'all-linear'`), trained one step so its B matrices are not
zero. Everything runs in this process on the engine itself, no server: the limit is the
engine's.

Possible: for each linear layer of the model (q, k, v, o, gate, up, down, and the output
layer), `F.linear` of `rows` rows in the model's dtype, timed over all of them as one step
runs them; the rate is their FLOPs over their time, best of 20 rounds (a round takes
about 20 ms, so a few rounds leave the rate to the machine's noise). `rows` is what the
row runs at: the RL group's 96 rows for decoding, a pass's 1,024 tokens for training.
The rate is measured again just before every round of every row, and a row's fraction is
the median of its rounds' achieved over their own rate: this machine's speed drifts by a
quarter from one minute to the next, and a rate from another minute would move the
fraction with it.

Achieved, counted from the config (`bench.flops.ModelFlops`, which says how), sampling at
the lengths the samples reached.

Rows:
1. decode, RL group: 24 prompts of 64 tokens x 4 samples x 128 new tokens (EOS off), one
   adapter, through `Engine.decode` until every request is done;
2. the same with 40 stop tokens, which the random model draws about once in 100 tokens:
   samples stop at uneven lengths and leave the batch, as in RL with real stops;
3. decode, mixed: 64 requests of one sample, 64-token prompts, `max_tokens` spread over
   8..256, all at once;
4. forward_backward of 8 x 128 tokens (packed, cross entropy).

Then decode attention alone, which is bound by reading the cache rather than by its
FLOPs: the RL group's attention halfway through (64 columns written a row), every layer's
cache apart, in bytes read (`ModelFlops.decode_read`) a second against this machine's
read rate (a sum over 1 GiB), measured just before.

Run: `.venv/bin/python -m bench.limit` (about two minutes on 2 CPU cores; also part of
`make bench`); `--rounds N` (default 3) per row; `--profile` also prints where a decode
step's time goes (torch's profiler over a few slices of the RL group, top operators by
self CPU time). `--batch-invariant` instead measures what `--batch-invariant on` costs:
the RL group and mixed rows on two engines of the same model, one with the mode off and
one with it on, their rounds interleaved (off, on, off, on, ...) so that both see the
same minutes of this machine. `--leaving` measures how the rows that stay move when
others leave (`kv_batch.compaction` against keeping their order, rounds interleaved on
one engine, with a row of 512-token prompts where moving rows costs most) and a decode
step's attention read through a block table against the pool's contiguous rows.
`--windows` measures a model with a sliding window of 128 on every other layer (as
gpt-oss) against the same weights with full attention, rounds interleaved: the RL group
and 16 rows of 64 + 896 tokens, tokens/s and the most KV positions the pool held. Figures
measure and print; nothing passes or fails on time.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from bench.data import random_datums
from bench.flops import ModelFlops
from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.types import (
    AdamParams,
    EngineLimits,
    LoraSpec,
    LossSpec,
    SampleRequest,
    SamplingParams,
)

SPEC = LoraSpec(rank=16, alpha=32, seed=0)
ADAPTER = "limit"
PROMPT = 64
GROUP_PROMPTS, GROUP_SAMPLES, GROUP_TOKENS = 24, 4, 128
MIXED_REQUESTS, MIXED_LOW, MIXED_HIGH = 64, 8, 256
TRAIN_ROWS, TRAIN_LENGTH = 8, 128
STOPS = tuple(range(100, 140))
LONG_PROMPT, LONG_REQUESTS = 512, 32
BLOCK = 16
"""Positions a page holds in `block_table_read` (vLLM's default block size)."""
WINDOW = 128
"""`--windows`: the sliding window of every other layer (gpt-oss's)."""
LONG_ROWS, LONG_TOKENS = 16, 896


def gemm_rate(engine: Engine, rows: int, rounds: int = 20) -> float:
    """FLOP/s of the model's linear layers at `rows` rows (module docstring)."""
    dtype, device = engine.base.dtype, engine.base.device
    flops = ModelFlops.of(engine.base.config, 0)
    weights = [(torch.randn(o, i, dtype=dtype, device=device),
                torch.randn(rows, i, dtype=dtype, device=device))
               for i, o in (*flops.linears, flops.head)]
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for w, _ in weights)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(rounds + 1):
            start = time.perf_counter()
            for weight, x in weights:
                F.linear(x, weight)
            best = min(best, time.perf_counter() - start)
    return flops / best


Run = tuple[float, int, int]
"""One round of a row: seconds, tokens (sampled, or trained), model FLOPs."""


def _sample(engine: Engine, flops: ModelFlops, requests: list[SampleRequest],
            held: list[int] | None = None) -> Run:
    """Decode `requests` to the end through the pool: seconds, sampled tokens, and the
    FLOPs of the forwards that drew them (from the lengths the samples reached); `held`
    gets the pool's KV positions in use after each slice."""
    keys = list(range(len(requests)))
    start = time.perf_counter()
    done = dict(engine.decode(requests, keys, 0.5))
    while len(done) < len(requests):
        if held is not None:
            held.append(engine.decode_stats().kv_in_use)
        done.update(engine.decode([], [], 0.5))
    seconds = time.perf_counter() - start
    failed = [out for out in done.values() if isinstance(out, Exception)]
    if failed:
        raise failed[0]
    tokens = total = 0
    for key, request in zip(keys, requests, strict=True):
        lengths = [sequence.tokens.size for sequence in done[key].sequences]
        total += flops.sampled(request.prompt.size, lengths)
        tokens += sum(lengths)
    return seconds, tokens, total


def _group(vocab: int, seed: int) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    return [SampleRequest(ADAPTER, None, rng.integers(3, vocab, PROMPT), GROUP_SAMPLES,
                          SamplingParams(max_tokens=GROUP_TOKENS, seed=seed * 100 + i,
                                         ignore_eos=True))
            for i in range(GROUP_PROMPTS)]


def _group_stopping(vocab: int, seed: int) -> list[SampleRequest]:
    """The RL group with `STOPS` stop tokens: the random model draws one about once in
    100 tokens, so samples end at uneven lengths and rows leave the batch as they stop."""
    return [replace(r, params=replace(r.params, stop_token_ids=STOPS))
            for r in _group(vocab, seed)]


def _mixed(vocab: int, seed: int) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    lengths = np.linspace(MIXED_LOW, MIXED_HIGH, MIXED_REQUESTS).astype(int)
    rng.shuffle(lengths)
    return [SampleRequest(ADAPTER, None, rng.integers(3, vocab, PROMPT), 1,
                          SamplingParams(max_tokens=int(n), seed=seed * 100 + i,
                                         ignore_eos=True))
            for i, n in enumerate(lengths)]


@dataclass(frozen=True)
class Row:
    """A row's rounds: each run's tokens/s, achieved FLOP/s, and the GEMM rate measured
    just before it (this machine's speed drifts by a quarter between minutes)."""

    name: str
    tokens_s: list[float]
    achieved: list[float]
    possible: list[float]
    rows: int

    def fraction(self) -> float:
        """The median of each round's achieved over its own possible."""
        return statistics.median(a / p for a, p in zip(self.achieved, self.possible,
                                                         strict=True))


def _rounds(run: Callable[[int], Run], possible: Callable[[], float], rounds: int
            ) -> list[tuple[Run, float]]:
    """`rounds` runs after one warm-up, each (with its own seed) right after its own
    measure of the GEMM rate, with that rate."""
    run(0)
    out = []
    for seed in range(1, rounds + 1):
        rate = possible()
        out.append((run(seed), rate))
    return out


def _row(name: str, rows: int, rounds: list[tuple[Run, float]]) -> Row:
    return Row(name, [tokens / s for (s, tokens, _), _ in rounds],
               [flops / s for (s, _, flops), _ in rounds], [rate for _, rate in rounds], rows)


def measure(engine: Engine, rounds: int) -> list[Row]:
    flops = ModelFlops.of(engine.base.config, SPEC.rank)
    vocab = engine.base.vocab_size
    out = []
    group_rows = GROUP_PROMPTS * GROUP_SAMPLES
    for name, make in (("decode, RL group 24 x 4 x 128", _group),
                       ("decode, RL group, stop tokens", _group_stopping),
                       ("decode, mixed 64 x 8..256", _mixed)):
        timed = _rounds(lambda seed, make=make: _sample(engine, flops, make(vocab, seed)),
                        lambda: gemm_rate(engine, group_rows), rounds)
        out.append(_row(name, group_rows, timed))
    batch = random_datums(TRAIN_ROWS, TRAIN_LENGTH, vocab)
    request = ForwardRequest(ADAPTER, batch, LossSpec("cross_entropy"), True)

    tokens = TRAIN_ROWS * TRAIN_LENGTH

    def train(_: int) -> Run:
        start = time.perf_counter()
        engine.forward_batch([request])
        engine.zero_grad(ADAPTER)
        return (time.perf_counter() - start, tokens,
                TRAIN_ROWS * flops.train_sequence(TRAIN_LENGTH))

    timed = _rounds(train, lambda: gemm_rate(engine, tokens), rounds + 2)
    out.append(_row(f"forward_backward {TRAIN_ROWS} x {TRAIN_LENGTH}", tokens, timed))
    return out


def read_rate(device: torch.device, dtype: torch.dtype, nbytes: int = 2**30) -> float:
    """Bytes/s this machine reads memory at: a sum over `nbytes`, best of 5."""
    x = torch.ones(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def attention_read(engine: Engine, own: int = GROUP_TOKENS // 2, rounds: int = 20
                   ) -> tuple[float, float]:
    """Bytes/s a decode step's attention reads the cache at, and this machine's read rate
    measured just before: the RL group halfway (96 rows, each request's 64-token prompt
    read once for its 4 samples, `own` columns each row wrote), every layer's cache
    apart as in a step, best of `rounds` steps' attention."""
    from types import SimpleNamespace

    from twinkle_server.engine.sampling.decode_attention import decode_attention, decoding
    from twinkle_server.engine.sampling.kv_batch import SharedPrefix

    config, dtype = engine.base.config, engine.base.dtype
    heads, kv_heads, dim = (config.num_attention_heads, config.num_key_value_heads,
                            config.head_dim)
    rows, layers = GROUP_PROMPTS * GROUP_SAMPLES, config.num_hidden_layers

    def cache(n: int, width: int) -> list[torch.Tensor]:
        return [torch.randn(n, kv_heads, width, dim, dtype=dtype) for _ in range(layers)]

    keys, values = cache(rows, PROMPT + own), cache(rows, PROMPT + own)
    shared = SharedPrefix(PROMPT, cache(GROUP_PROMPTS, PROMPT), cache(GROUP_PROMPTS, PROMPT),
                          GROUP_SAMPLES)
    query = torch.randn(rows, heads, 1, dim, dtype=dtype)
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    modules = [SimpleNamespace(layer_idx=i) for i in range(layers)]
    read = ModelFlops.of(config, SPEC.rank).decode_read(
        GROUP_PROMPTS, PROMPT, rows, own, torch.finfo(dtype).bits // 8)
    possible = read_rate(engine.base.device, dtype)
    best = float("inf")
    with torch.inference_mode(), decoding(model, shared):   # type: ignore[arg-type]
        for _ in range(rounds + 1):
            start = time.perf_counter()
            for module, k, v in zip(modules, keys, values, strict=True):
                decode_attention(module, query, k, v, None)
            best = min(best, time.perf_counter() - start)
    return read / best, possible


def profile(engine: Engine, slices: int = 6) -> None:
    """Where a decode slice's time goes: the RL group decoding, top operators."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    requests = _group(engine.base.vocab_size, 7)
    keys = list(range(len(requests)))
    done = dict(engine.decode(requests, keys, 0.2))   # prefill and the first steps
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(slices):
            done.update(engine.decode([], [], 0.2))
        wall = time.perf_counter() - start
    steps = engine.decode_stats().decode_steps
    while len(done) < len(requests):
        done.update(engine.decode([], [], 0.5))
    print(f"profile: {slices} decode slices of the RL group ({wall:.2f} s wall, "
          f"{steps} steps so far); top operators by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def _engine(path: str, batch_invariant: bool = False) -> Engine:
    """The bench's engine on the wide base at `path`, its adapter trained one step."""
    engine = Engine.load(path, device="cpu", batch_invariant=batch_invariant,
                         limits=EngineLimits(max_seq_len=1024, kv_pool_tokens=65_536))
    engine.add_adapter(ADAPTER, SPEC)
    engine.forward_batch([ForwardRequest(ADAPTER, random_datums(2, 32, engine.base.vocab_size),
                                         LossSpec("cross_entropy"), True)])
    engine.optim_step(ADAPTER, AdamParams(learning_rate=1e-2))
    return engine


def invariant_cost(path: str, rounds: int, shorter: int = 1) -> None:
    """Tokens/s of the RL group and mixed rows with `--batch-invariant` off and on, rounds
    interleaved; prints the medians and the cost (1 - on / off). `shorter` divides every
    request's `max_tokens` (the mode's rows take minutes each at full length)."""
    engines = {mode: _engine(path, mode) for mode in (False, True)}
    flops = ModelFlops.of(engines[False].base.config, SPEC.rank)
    vocab = engines[False].base.vocab_size
    print(f"batch-invariant cost ({torch.get_num_threads()} threads, float32, hidden 512, "
          f"8 layers, LoRA rank 16 all-linear; medians of {rounds} interleaved rounds)")
    print(f"  {'row':<34}{'off tok/s':>10}{'on tok/s':>10}{'cost':>7}")
    def short(make: Callable[[int, int], list[SampleRequest]]
              ) -> Callable[[int, int], list[SampleRequest]]:
        return lambda vocab, seed: [replace(r, params=replace(
            r.params, max_tokens=max(r.params.max_tokens // shorter, 1)))
            for r in make(vocab, seed)]

    for name, make in ((f"decode, RL group 24 x 4 x {GROUP_TOKENS // shorter}", short(_group)),
                       (f"decode, mixed 64 x {MIXED_LOW // shorter}..{MIXED_HIGH // shorter}",
                        short(_mixed))):
        speeds: dict[bool, list[float]] = {False: [], True: []}
        for engine in engines.values():      # a short warm-up each
            _sample(engine, flops, make(vocab, 0)[:2])
        for seed in range(1, rounds + 1):
            for mode, engine in engines.items():
                seconds, tokens, _ = _sample(engine, flops, make(vocab, seed))
                speeds[mode].append(tokens / seconds)
        off, on = (statistics.median(speeds[mode]) for mode in (False, True))
        print(f"  {name:<34}{off:>10.0f}{on:>10.0f}{1 - on / off:>7.0%}")
    pass_cost(engines[False], rounds)
    training_in_company(engines[False])


def leaving_cost(path: str, rounds: int) -> None:
    """Tokens/s of the rows whose samples leave the batch at uneven steps, with the kept
    rows moved as the pool moves them (`kv_batch.compaction`: a stopped row's place
    taken by its route's last row) and with the rows kept in their order (every row
    after the first that leaves moves), rounds interleaved on one engine; then what a
    decode step's attention costs read through a block table (`block_table_read`)."""
    from twinkle_server.engine.sampling import book

    engine = _engine(path)
    flops = ModelFlops.of(engine.base.config, SPEC.rank)
    vocab = engine.base.vocab_size
    arms = {"order kept": lambda routes, keep: list(keep), "compaction": book.compaction}
    print(f"rows leaving the decode batch ({torch.get_num_threads()} threads, float32, "
          f"hidden 512, 8 layers, LoRA rank 16 all-linear; medians of {rounds} interleaved "
          "rounds)")
    print(f"  {'row':<46}{'order kept':>11}{'compaction':>11}{'ratio':>7}")

    def long_prompts(vocab: int, seed: int) -> list[SampleRequest]:
        rng = np.random.default_rng(seed)
        return [replace(r, prompt=rng.integers(3, vocab, LONG_PROMPT))
                for r in _mixed(vocab, seed)][:LONG_REQUESTS]

    for name, make in (("decode, RL group, stop tokens", _group_stopping),
                       ("decode, mixed 64 x 8..256", _mixed),
                       (f"decode, mixed {LONG_REQUESTS} x 8..256, {LONG_PROMPT}-token prompts",
                        long_prompts)):
        speeds: dict[str, list[float]] = {arm: [] for arm in arms}
        _sample(engine, flops, make(vocab, 0)[:2])
        for seed in range(1, rounds + 1):
            for arm, order in arms.items():
                book.compaction = order
                try:
                    seconds, tokens, _ = _sample(engine, flops, make(vocab, seed))
                finally:
                    book.compaction = arms["compaction"]
                speeds[arm].append(tokens / seconds)
        kept, moved = (statistics.median(speeds[arm]) for arm in arms)
        print(f"  {name:<46}{kept:>11.0f}{moved:>11.0f}{moved / kept:>6.2f}x")
    contiguous, paged = block_table_read(engine)
    print(f"  a decode step's attention, {GROUP_PROMPTS * GROUP_SAMPLES} rows x "
          f"{PROMPT + GROUP_TOKENS} positions, every layer: {contiguous * 1e3:.1f} ms on each "
          f"row's contiguous cache, {paged * 1e3:.1f} ms read through a block table of "
          f"{BLOCK}-position pages ({paged / contiguous:.1f}x)")


def block_table_read(engine: Engine, rounds: int = 10) -> tuple[float, float]:
    """Seconds of one decode step's attention over every layer of the RL group's cache
    at its full length: on each row's keys and values as the pool holds them (contiguous
    per row), and read through a block table of `BLOCK`-position pages scattered in one
    pool, as a paged cache holds them; torch has no CPU kernel that reads through a table,
    so the pages are gathered first (`index_select`), which is the cost measured."""
    config = engine.base.config
    rows, width = GROUP_PROMPTS * GROUP_SAMPLES, PROMPT + GROUP_TOKENS
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    pages = width // BLOCK
    query = torch.randn(rows, kv_heads, heads // kv_heads, dim)
    contiguous = [(torch.randn(rows, kv_heads, width, dim), torch.randn(rows, kv_heads, width,
                                                                         dim))
                  for _ in range(config.num_hidden_layers)]
    pool = [(torch.randn(rows * pages, kv_heads, BLOCK, dim),
             torch.randn(rows * pages, kv_heads, BLOCK, dim))
            for _ in range(config.num_hidden_layers)]
    table = torch.randperm(rows * pages).reshape(rows, pages)

    def attend(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(torch.matmul(query, keys.transpose(-1, -2)), dim=-1)
        return torch.matmul(weights, values)

    def through_table(layer: torch.Tensor) -> torch.Tensor:
        return (layer.index_select(0, table.flatten()).reshape(rows, pages, kv_heads, BLOCK,
                                                              dim)
                .transpose(1, 2).reshape(rows, kv_heads, pages * BLOCK, dim))

    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, step in enumerate((lambda: [attend(k, v) for k, v in contiguous],
                                  lambda: [attend(through_table(k), through_table(v))
                                           for k, v in pool])):
            start = time.perf_counter()
            step()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def pass_cost(engine: Engine, rounds: int) -> None:
    """Seconds of a training-shaped forward (`TRAIN_ROWS` x `TRAIN_LENGTH` tokens, padded
    rows, no gradient) through the base and its adapter with the mode's construction
    (`batch_invariant.computing`) and without, interleaved: the least a batch-invariant
    training pass would cost, before its backward."""
    from twinkle_server.engine import batch_invariant

    ids = torch.from_numpy(np.stack([d.input_ids for d in random_datums(
        TRAIN_ROWS, TRAIN_LENGTH, engine.base.vocab_size)]))
    mask = torch.ones_like(ids)
    model = engine.base.model
    seconds: dict[bool, list[float]] = {False: [], True: []}
    with torch.inference_mode(), engine.router.route([ADAPTER] * TRAIN_ROWS):
        for _ in range(rounds + 1):
            for mode in (False, True):
                start = time.perf_counter()
                with batch_invariant.computing(model) if mode else contextlib.nullcontext():
                    model(input_ids=ids, attention_mask=mask, use_cache=False)
                seconds[mode].append(time.perf_counter() - start)
    off, on = (statistics.median(seconds[mode][1:]) for mode in (False, True))
    print(f"  {'forward 8 x 128 (no grad), s':<34}{off:>10.3f}{on:>10.3f}{1 - off / on:>7.0%}"
          "  (cost here: 1 - off / on seconds)")


def training_in_company(engine: Engine) -> None:
    """What `forward_backward` of one tenant gives alone and merged into one pass with
    another tenant's datums (no batch-invariant mode for training): how many of its
    logprobs and gradient elements differ in their bits, and by how much at most."""
    other = "limit-other"
    engine.add_adapter(other, replace(SPEC, seed=1))
    vocab = engine.base.vocab_size
    mine = ForwardRequest(ADAPTER, random_datums(4, 96, vocab, seed=1),
                          LossSpec("cross_entropy"), True)
    theirs = ForwardRequest(other, random_datums(6, 150, vocab, seed=2),
                            LossSpec("cross_entropy"), True)

    def run(requests: list[ForwardRequest]) -> tuple[np.ndarray, np.ndarray]:
        out = engine.forward_batch(requests)[requests.index(mine)]
        grads = torch.cat([p.grad.reshape(-1) for p in engine.adapters[ADAPTER].parameters()])
        engine.zero_grad(ADAPTER)
        engine.zero_grad(other)
        return np.concatenate(out.logprobs), grads.numpy().copy()

    alone = run([mine])
    for where, merged in (("first", run([mine, theirs])), ("second", run([theirs, mine]))):
        for name, a, b in zip(("logprobs", "gradient"), alone, merged, strict=True):
            worst = float(np.abs(a - b).max())
            print(f"  training alone vs merged ({where} in the pass), {name}: "
                  f"{int((a != b).sum())} of {a.size} elements differ in their bits; largest "
                  f"difference {worst:.3g} ({worst / float(np.abs(a).max()):.2g} of the "
                  "largest element)")
    engine.remove_adapter(other)


def windows_cost(directory: str, rounds: int) -> None:
    """A model with a sliding window on every other layer (`WINDOW`, as gpt-oss) decoding
    rows that outgrow the window, against the same weights with every layer full
    attention (what the pool held and read for a window before it kept only the window):
    tokens/s, medians of interleaved rounds (each arm first in every other round: the one
    run second read up to 10% slower), and the most KV positions the pool held."""
    from bench.engine import _windowed_base

    engines = {name: _engine(_windowed_base(f"{directory}/{name}", window))
               for name, window in (("every column", None), ("window kept", WINDOW))}
    flops = ModelFlops.of(engines["every column"].base.config, SPEC.rank)
    vocab = engines["every column"].base.vocab_size
    print(f"sliding windows of {WINDOW} on 4 of 8 layers ({torch.get_num_threads()} threads, "
          f"float32, hidden 512, LoRA rank 16 all-linear; medians of {rounds} interleaved "
          "rounds; KV: the most positions the pool held)")
    print(f"  {'row':<40}" + "".join(f"{name + ' tok/s':>20}{'KV':>8}" for name in engines)
          + f"{'ratio':>7}")

    def long_rows(vocab: int, seed: int) -> list[SampleRequest]:
        rng = np.random.default_rng(seed)
        return [SampleRequest(ADAPTER, None, rng.integers(3, vocab, PROMPT), 1,
                              SamplingParams(max_tokens=LONG_TOKENS, seed=seed * 100 + i,
                                             ignore_eos=True))
                for i in range(LONG_ROWS)]

    for name, make in (("decode, RL group 24 x 4 x 128", _group),
                       (f"decode, {LONG_ROWS} x {PROMPT} + {LONG_TOKENS} tokens", long_rows)):
        speeds: dict[str, list[float]] = {arm: [] for arm in engines}
        peaks = dict.fromkeys(engines, 0)
        for engine in engines.values():
            _sample(engine, flops, make(vocab, 0)[:2])
        for seed in range(1, rounds + 1):
            arms = list(engines.items())
            for arm, engine in arms if seed % 2 else arms[::-1]:   # either arm first in turn
                held: list[int] = []
                seconds, tokens, _ = _sample(engine, flops, make(vocab, seed), held)
                speeds[arm].append(tokens / seconds)
                peaks[arm] = max(peaks[arm], *held, 0)
        medians = {arm: statistics.median(speeds[arm]) for arm in engines}
        print(f"  {name:<40}" + "".join(f"{medians[arm]:>20.0f}{peaks[arm]:>8}"
                                       for arm in engines)
              + f"{medians['window kept'] / medians['every column']:>6.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="achieved over possible FLOP/s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="measure what --batch-invariant on costs instead")
    parser.add_argument("--shorter", type=int, default=1,
                        help="with --batch-invariant: divide every max_tokens by this")
    parser.add_argument("--leaving", action="store_true",
                        help="measure how the rows that stay are moved when others leave "
                             "instead")
    parser.add_argument("--windows", action="store_true",
                        help="measure a model with sliding windows against the same weights "
                             "with full attention instead")
    args = parser.parse_args(argv)
    from bench.engine import _wider_base

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        if args.windows:
            windows_cost(tmp, args.rounds)
            return
        path = _wider_base(f"{tmp}/wide")
        if args.batch_invariant:
            invariant_cost(path, args.rounds, args.shorter)
            return
        if args.leaving:
            leaving_cost(path, args.rounds)
            return
        engine = _engine(path)
    rows = measure(engine, args.rounds)
    print(f"limit: achieved model FLOP/s over this machine's GEMM rate on the model's own "
          f"shapes ({torch.get_num_threads()} threads, {engine.base.dtype}, hidden 512, 8 "
          f"layers, LoRA rank 16 all-linear)")
    print(f"  {'row':<34}{'tokens/s':>10}{'achieved GFLOP/s':>18}{'possible':>10}"
          f"{'at rows':>9}{'fraction':>10}")
    for row in rows:
        print(f"  {row.name:<34}{statistics.median(row.tokens_s):>10.0f}"
              f"{statistics.median(row.achieved) / 1e9:>18.1f}"
              f"{statistics.median(row.possible) / 1e9:>10.1f}{row.rows:>9}"
              f"{row.fraction():>9.0%}")
    print("  (medians over the rounds; fraction: the median of each round's achieved over "
          "the GEMM rate measured just before it)")
    achieved, possible = attention_read(engine)
    print(f"  decode attention, RL group halfway: reads the cache at {achieved / 1e9:.1f} "
          f"GB/s, {achieved / possible:.0%} of this machine's read rate "
          f"({possible / 1e9:.1f} GB/s, a sum over 1 GiB): bound by memory, not FLOPs")
    if args.profile:
        profile(engine)


if __name__ == "__main__":
    main()
