"""GPU benchmark (issue 17): the engine on Qwen3-0.6B- and Qwen3-4B-shaped bases, bf16.

Run: `python3 -m bench.gpu 2>&1 | tee gpu.txt` on a machine with one CUDA device
(sized to run unattended in under 8 minutes; `.venv/bin/python` where the venv is there);
`--device cpu --small` is a smoke check of the same code path on tiny shapes (seconds).
Not part of `make bench` (which runs on CPU). Exits 2 when no CUDA device is present, 1
when a check below fails or a row could not run, else 0.

For each shape, a random-initialised model with the published Qwen3 sizes (no download)
is saved with the tiny model's tokenizer to a temp dir, then each row loads it afresh:

- `engine`: forward_backward + optim_step of 8 x 2048 tokens, rank 16 all-linear, in
  pieces of the pass cap a server picks by default (`--max-pass-tokens 0`: the most
  tokens whose estimated activations fit half the memory free), then in one piece (what
  calibrates the estimate; the 4B shape is expected to run out of memory there);
- the same with `--activation-checkpointing on` (what checks that flag's `auto` default,
  on only where one datum would not fit otherwise: its larger cap against the extra
  forward that pieces cost without it);
- 8 tenants each sending 1 x 512, merged (one `Engine.forward_batch` of 8 requests)
  vs timeshare (8 calls);
- 8 tenants x 2 datums of lengths uniform in 64..2048 in one merged pass, packed vs
  padded (`--packing off`);
- a plain transformers + peft loop on the same model, data and adapter;
- the engine step under torch.distributed with one rank (nccl; the FSDP2 path of
  `--nproc-per-node`).

Each row: tokens/s (the median step), model FLOPs utilisation against this device's bf16
matmul peak measured here (an 8192^3 matmul timed with CUDA events), and peak memory
(`torch.cuda.max_memory_allocated`). The engine's own pass headroom estimates
(`engine.memory`) and the pass cap are printed beside it. A row that runs out of memory
says so, an adapter the memory estimate refuses is measured anyway (and said so), and a
row function that fails is reported: the run goes on to the table.

Checks (after the table), on the first shape: packed == padded logprobs, in bf16 (flash
sdpa) and float32 (memory-efficient sdpa); in a packed pass, changing one datum's tokens
leaves another's logprobs unchanged (float32); checkpointing on and off train alike.

Model FLOPs per token, frozen base + LoRA: forward 2N and backward 2N (input gradients
only; no weight gradients for the base), N the linear layers' weights (lm_head included),
plus causal attention 6 x layers x Q x seq (QK^T and AV forward, twice that backward, half
the positions masked). LoRA's own FLOPs (rank 16) are under 1% and not counted; neither
is the forward that activation checkpointing, or a pass in pieces, runs again, so MFU is
the useful share.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.data import mixed_datums, random_datums
from twinkle_server.engine.types import (
    AUTO_PASS_TOKENS,
    AdamParams,
    Datum,
    EngineLimits,
    LoraSpec,
    LossSpec,
)

# Published sizes (the models' config.json on the Hugging Face hub).
SHAPES: dict[str, dict] = {
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151_936, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151_936, tie_word_embeddings=True),
}
SMALL_SHAPES: dict[str, dict] = {
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=4096,
                  tie_word_embeddings=True),
}
CE = LossSpec("cross_entropy")
ADAM = AdamParams(learning_rate=1e-4)
SPEC = LoraSpec(rank=16, alpha=32, seed=0)
TENANTS = 8
CHECK_DATUMS = 6
COLLECTIVE_TIMEOUT_S = 120
"""Short of the device call's 10 minutes: a hung nccl collective fails the FSDP2 row."""
NO_CUDA_EXIT = 2
CHECK_FAILED_EXIT = 1

# Check tolerances. float32: a 28-layer pass summed in other orders (other GEMM shapes,
# another attention kernel) drifts ~1e-6 a layer; the CPU tests hold the 4-layer tiny
# model to 1e-5. bf16 (unit roundoff 2^-8 = 3.9e-3 on every activation, accumulations in
# float32) only catches gross errors: a datum attending to another moves its logprobs by
# far more. Isolation compares the same shapes, so only kernel non-determinism remains.
FLOAT32_LOGPROB_ATOL = 1e-4
BF16_LOGPROB_ATOL = 0.1
ISOLATION_ATOL = 1e-5
BF16_LOSS_RTOL = 1e-2


@dataclass
class Table:
    """The rows and checks of one run, printed as they come and again at the end."""

    device: torch.device
    peak_flops: float
    rows: list[tuple[str, str, float, float, float | None]] = field(default_factory=list)
    checks: list[tuple[str, str, float, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def guard(self, model: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, or None after printing and recording its exception: one broken
        row function must not cost the rest of the table."""
        try:
            return fn(*args)
        except Exception as exc:
            traceback.print_exc()
            self.failures.append(f"{model}: {what}: {type(exc).__name__}: {str(exc)[:300]}")
            return None

    def time(self, model: str, run: str, step: Callable[[], object], tokens: int,
             flops_per_step: float, steps: int) -> None:
        """One row: `step` timed (median of `steps` after one warmup), or out of memory."""
        from twinkle_server.engine.errors import ResourceExhausted

        _reset_peak(self.device)
        try:
            seconds = _median_seconds(step, self.device, steps)
            row = (model, run, tokens / seconds, flops_per_step / seconds / self.peak_flops,
                   _peak(self.device))
        except (torch.OutOfMemoryError, ResourceExhausted) as exc:
            print(f"{model}: {run}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            row = (model, f"{run} (out of memory)", float("nan"), float("nan"),
                   _peak(self.device))
        self.rows.append(row)
        print(f"{_clock()} {_format_row(row)}", flush=True)

    def check(self, model: str, what: str, value: float, tolerance: float) -> None:
        self.checks.append((model, what, value, tolerance))
        print(f"{_clock()} check {model}: {what}: {value:.3g} (tolerance {tolerance:.0e})",
              flush=True)

    @property
    def failed(self) -> bool:
        return bool(self.failures) or any(not value <= tolerance
                                          for _, _, value, tolerance in self.checks)

    def print(self, args: argparse.Namespace) -> None:
        print(f"rank 16 all-linear, forward_backward (+ optim_step for the {args.rows} x "
              f"{args.length} rows), median of {args.steps} timed steps after one warmup")
        print(f"  {'model':<12}{'run':<44}{'tokens/s':>11}{'MFU':>8}{'peak GiB':>10}")
        for row in self.rows:
            print(f"  {_format_row(row)}")
        print("checks")
        for model, what, value, tolerance in self.checks:
            verdict = "ok" if value <= tolerance else "FAILED"
            print(f"  {model:<12}{what:<60}{value:>10.3g}  <= {tolerance:.0e}  {verdict}")
        for failure in self.failures:
            print(f"  FAILED to run: {failure}")


def _format_row(row: tuple[str, str, float, float, float | None]) -> str:
    model, run, speed, util, peak_gib = row
    mem = f"{peak_gib:>10.2f}" if peak_gib is not None else f"{'n/a':>10}"
    return f"{model:<12}{run:<44}{speed:>11.0f}{util:>8.1%}{mem}"


def _clock() -> str:
    return time.strftime("%H:%M:%S")



def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], device: torch.device, steps: int) -> float:
    """Median seconds per call of `steps` calls, after one unmeasured call."""
    fn()
    _sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an `n x n` matmul in `dtype` (CUDA events on a GPU), best of 3 rounds
    after a warmup round, on random data (zeros run faster than real data)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    iters, best = 10, 0.0
    for round_ in range(4):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                a @ b
            end.record()
            torch.cuda.synchronize(device)
            seconds = start.elapsed_time(end) / 1000
        else:
            began = time.perf_counter()
            for _ in range(iters):
                a @ b
            seconds = time.perf_counter() - began
        if round_:
            best = max(best, 2 * n**3 * iters / seconds)
    return best


def flops_per_token(config, seq: int) -> float:
    """Model FLOPs of one trained token of a `seq`-token datum (module docstring)."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    linear = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter) + h * config.vocab_size
    return 4 * linear + 6 * layers * q * seq


def step_flops(config, datums: list[Datum]) -> float:
    """Model FLOPs of one forward_backward over `datums` (attention by each one's length)."""
    return sum(flops_per_token(config, d.num_tokens) * d.num_tokens for d in datums)


def build_model(out: Path, shape: dict, dtype: torch.dtype, device: torch.device) -> None:
    """A random Qwen3 of `shape` saved to `out` with the tiny model's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from twinkle_server.engine.tiny_model import build_tiny_model

    tiny = build_tiny_model()
    config = Qwen3Config(**shape, max_position_embeddings=40_960, rope_theta=1_000_000.0,
                         bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(out)
    del model
    for f in Path(tiny).iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out)


def _peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load_engine(path: Path, args: argparse.Namespace, dtype: str | None = None, **options):
    """An `Engine` on `path` with the bench's limits and pass cap (`args.pass_tokens`: a
    server's default, picked from the memory free); `bench_shape` frees it after."""
    from twinkle_server.engine.engine import Engine

    limits = EngineLimits(max_adapters=TENANTS + 2, max_seq_len=args.length,
                          max_batch_tokens=max(args.rows * args.length,
                                               CHECK_DATUMS * args.mixed_lengths[1]),
                          max_pass_tokens=args.pass_tokens)
    return Engine.load(str(path), device=args.device, dtype=dtype or args.dtype,
                       limits=limits, **options)


def add_measured_adapter(engine, name: str, adapter_id: str) -> None:
    """Add `adapter_id`; when the engine's estimate refuses it, add it anyway and say so:
    the measured peak is what calibrates the estimate."""
    import twinkle_server.engine.engine as engine_module
    from twinkle_server.engine.errors import ResourceExhausted

    try:
        engine.add_adapter(adapter_id, SPEC)
    except ResourceExhausted as exc:
        print(f"{name}: the engine refuses the adapter ({exc}); measuring anyway", flush=True)
        real = engine_module.available_memory_bytes
        engine_module.available_memory_bytes = lambda device: None
        try:
            engine.add_adapter(adapter_id, SPEC)
        finally:
            engine_module.available_memory_bytes = real


def describe_memory(name: str, engine, args: argparse.Namespace, label: str) -> None:
    """Print the pass cap a server would pick here and the engine's headroom estimates:
    for a piece of that cap, and for the bench's whole pass as one piece."""
    from twinkle_server.engine import memory

    base, tokens = engine.base, args.rows * args.length
    whole = memory.pass_headroom_bytes(base.config, base.dtype, base.vocab_size, tokens,
                                       engine.activation_checkpointing)
    auto = memory.auto_checkpointing(base.config, base.dtype, base.vocab_size,
                                     base.device.type, memory.available_memory_bytes(
                                         base.device), args.length)
    picked = ("what --max-pass-tokens 0 picks here" if args.pass_tokens == AUTO_PASS_TOKENS
              else "the smoke run's")
    print(f"{name} ({label}): passes run in pieces of at most "
          f"{engine.limits.max_pass_tokens} tokens ({picked}), "
          f"pass headroom estimate {engine.pass_headroom_bytes / 2**30:.2f} GiB; "
          f"{whole / 2**30:.2f} GiB for {args.rows} x {args.length} tokens in one piece; "
          f"--activation-checkpointing auto would turn it {'on' if auto else 'off'}",
          flush=True)


def run_batch(engine, requests: list) -> list:
    """`engine.forward_batch(requests)`, raising the first request's failure (the engine
    returns failures, running out of memory included, as values)."""
    outputs = engine.forward_batch(requests)
    for out in outputs:
        if isinstance(out, Exception):
            raise out
    return outputs


def train_steps(engine, adapter_id: str, batch: list[Datum], losses: list[float]
                ) -> Callable[[], None]:
    """One forward_backward + optim_step of `batch`; each step's loss goes to `losses`."""
    from twinkle_server.engine.engine import ForwardRequest

    def step() -> None:
        (out,) = run_batch(engine, [ForwardRequest(adapter_id, batch, CE, True)])
        losses.append(out.loss)
        engine.optim_step(adapter_id, ADAM)

    return step


@contextmanager
def one_piece(engine) -> Iterator[None]:
    """Passes in one piece, whatever the engine's pass cap (`--max-pass-tokens`)."""
    capped = engine.limits
    engine.limits = replace(capped, max_pass_tokens=0)
    try:
        yield
    finally:
        engine.limits = capped


def engine_label(engine, args: argparse.Namespace, extra: str = "") -> str:
    """`engine R x L`, the pass cap when the pass runs in pieces, and `extra`."""
    cap = engine.limits.max_pass_tokens
    pieces = f", pieces <= {cap}" if cap < args.rows * args.length else ""
    return f"engine {args.rows} x {args.length}{pieces}{extra}"


def engine_rows(name: str, path: Path, adapter_dir: str, args: argparse.Namespace,
                table: Table, checks: bool) -> list[float]:
    """The plain engine's rows; saves the trained adapter to `adapter_dir`; with `checks`,
    the packing checks on this engine. Returns the training steps' losses."""
    engine = load_engine(path, args)
    add_measured_adapter(engine, name, "bench")
    describe_memory(name, engine, args, "activation checkpointing off")
    try:
        return _engine_rows(name, engine, args, table, checks)
    finally:
        engine.save_weights("bench", adapter_dir)


def _engine_rows(name: str, engine, args: argparse.Namespace, table: Table, checks: bool
                 ) -> list[float]:
    from twinkle_server.engine.engine import ForwardRequest

    config, vocab = engine.base.config, engine.base.vocab_size
    batch = random_datums(args.rows, args.length, vocab)
    losses: list[float] = []
    table.time(name, engine_label(engine, args), train_steps(engine, "bench", batch, losses),
               args.rows * args.length, step_flops(config, batch), args.steps)
    # The same pass in one piece: what the headroom estimate for it is calibrated by.
    with one_piece(engine):
        table.time(name, f"engine {args.rows} x {args.length}, one piece",
                   train_steps(engine, "bench", batch, []), args.rows * args.length,
                   step_flops(config, batch), args.steps)

    tenants = [f"t{i}" for i in range(TENANTS)]
    for tenant in tenants:
        add_measured_adapter(engine, name, tenant)
    small = [random_datums(1, args.tenant_length, vocab, seed=i) for i in range(TENANTS)]
    requests = [ForwardRequest(t, d, CE, True) for t, d in zip(tenants, small, strict=True)]
    flops = sum(step_flops(config, d) for d in small)
    tokens = TENANTS * args.tenant_length
    table.time(name, f"{TENANTS} tenants x 1 x {args.tenant_length} merged",
               lambda: run_batch(engine, requests), tokens, flops, args.steps)
    table.time(name, f"{TENANTS} tenants x 1 x {args.tenant_length} timeshare",
               lambda: [run_batch(engine, [r]) for r in requests], tokens, flops,
               args.steps)

    low, high = args.mixed_lengths
    mixed = [mixed_datums(2, low, high, vocab, seed=i) for i in range(TENANTS)]
    requests = [ForwardRequest(t, d, CE, True) for t, d in zip(tenants, mixed, strict=True)]
    tokens = sum(d.num_tokens for batch_ in mixed for d in batch_)
    flops = sum(step_flops(config, d) for d in mixed)
    for packed in (True, False):
        def merged(packed: bool = packed) -> None:
            engine.packing = packed
            run_batch(engine, requests)

        table.time(name, f"{TENANTS} x 2 of {low}..{high} tokens, "
                   f"{'packed' if packed else 'padded'}", merged, tokens, flops,
                   args.steps)
    engine.packing = True
    if checks:
        packing_checks(name, engine, mixed, table, "bf16" if args.dtype == "bfloat16"
                       else args.dtype, BF16_LOGPROB_ATOL if args.dtype == "bfloat16"
                       else FLOAT32_LOGPROB_ATOL)
    return losses


def _forward_logprobs(engine, adapter_id: str, datums: list[Datum]) -> list[np.ndarray]:
    from twinkle_server.engine.engine import ForwardRequest

    return run_batch(engine, [ForwardRequest(adapter_id, datums, CE, False)])[0].logprobs


def packing_checks(name: str, engine, mixed: list[list[Datum]], table: Table, dtype: str,
                   atol: float) -> None:
    """Packed == padded logprobs (forward only) on datums of mixed lengths."""
    datums = [d for batch in mixed for d in batch][:CHECK_DATUMS]
    with one_piece(engine):
        engine.packing = False
        padded = _forward_logprobs(engine, "bench", datums)
        engine.packing = True
        packed = _forward_logprobs(engine, "bench", datums)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(packed, padded, strict=True))
    table.check(name, f"{dtype} packed vs padded, max |logprob diff|", diff, atol)


def isolation_check(name: str, engine, lengths: tuple[int, int], table: Table) -> None:
    """In one packed pass, datum 1's logprobs whatever datum 0's tokens are."""
    vocab = engine.base.vocab_size
    first, second = mixed_datums(2, *lengths, vocab, seed=7)
    changed = random_datums(1, first.num_tokens, vocab, seed=99)[0]
    with one_piece(engine):
        before = _forward_logprobs(engine, "bench", [first, second])[1]
        after = _forward_logprobs(engine, "bench", [changed, second])[1]
    table.check(name, "float32 packed: other datum's tokens changed, max |logprob diff|",
                float(np.abs(before - after).max()), ISOLATION_ATOL)


def float32_checks(name: str, path: Path, adapter_dir: str, args: argparse.Namespace,
                   table: Table) -> None:
    """The packing and isolation checks on a float32 load (memory-efficient sdpa on CUDA,
    where bf16 runs flash), with the adapter the bf16 engine trained."""
    engine = load_engine(path, args, dtype="float32")
    add_measured_adapter(engine, name, "bench")
    engine.load_state("bench", adapter_dir, include_optimizer=False)
    vocab = engine.base.vocab_size
    low, high = args.mixed_lengths
    mixed = [mixed_datums(2, low, high, vocab, seed=i) for i in range(3)]
    packing_checks(name, engine, mixed, table, "float32", FLOAT32_LOGPROB_ATOL)
    isolation_check(name, engine, args.mixed_lengths, table)


def checkpointing_rows(name: str, path: Path, args: argparse.Namespace, table: Table,
                       plain_losses: list[float]) -> None:
    """The engine row with `--activation-checkpointing on`, and its losses against the
    plain engine's (the same seeded adapter, data and steps)."""
    engine = load_engine(path, args, activation_checkpointing=True)
    add_measured_adapter(engine, name, "bench")
    describe_memory(name, engine, args, "activation checkpointing on")
    batch = random_datums(args.rows, args.length, engine.base.vocab_size)
    losses: list[float] = []
    table.time(name, engine_label(engine, args, ", activation ckpt"),
               train_steps(engine, "bench", batch, losses), args.rows * args.length,
               step_flops(engine.base.config, batch), args.steps)
    if losses and len(losses) == len(plain_losses):
        table.check(name, "activation ckpt on vs off, last step's loss, relative diff",
                    abs(losses[-1] - plain_losses[-1]) / abs(plain_losses[-1]), BF16_LOSS_RTOL)


def peft_row(name: str, path: Path, adapter_dir: str, args: argparse.Namespace,
             table: Table) -> None:
    """The same step as a plain transformers + peft loop (full logits, no packing)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)
                                                ).to(device)
    batch = random_datums(args.rows, args.length, int(base.config.vocab_size))
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2),
                            eps=ADAM.eps)
    ids = torch.from_numpy(np.stack([d.input_ids for d in batch])).to(device)
    targets = torch.from_numpy(np.stack([d.loss_inputs["target_tokens"] for d in batch])
                               ).to(device)

    def step() -> None:
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                 reduction="sum")
        loss.backward()
        opt.step()
        opt.zero_grad()

    table.time(name, f"transformers + peft {args.rows} x {args.length}", step,
               args.rows * args.length, step_flops(base.config, batch), args.steps)


def distributed_row(name: str, path: Path, args: argparse.Namespace, table: Table) -> None:
    """The engine's step under torch.distributed with one rank (nccl on CUDA, gloo on
    CPU): the FSDP2 path of `--nproc-per-node`, against the plain engine row."""
    from twinkle_server.engine.parallel import Parallel, placement_from_env

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    parallel = None
    try:
        parallel = Parallel.init(placement_from_env(args.device),
                                 timeout_s=COLLECTIVE_TIMEOUT_S)
        engine = load_engine(path, args, parallel=parallel)
        add_measured_adapter(engine, name, "bench")
        batch = random_datums(args.rows, args.length, engine.base.vocab_size)
        table.time(name, engine_label(engine, args, ", FSDP2 1 rank"),
                   train_steps(engine, "bench", batch, []), args.rows * args.length,
                   step_flops(engine.base.config, batch), args.steps)
    finally:
        if parallel is not None:
            parallel.close()
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key)


def bench_shape(name: str, path: Path, args: argparse.Namespace, table: Table,
                checks: bool) -> None:
    """Every row of one shape, each function on a fresh load, freed before the next
    (engines hold reference cycles: `_free` collects them). A function that fails is
    reported and the next one runs."""
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dir = f"{tmp}/adapter"
        losses = table.guard(name, "engine rows", engine_rows, name, path, adapter_dir, args,
                             table, checks) or []
        _free(device)
        table.guard(name, "activation checkpointing", checkpointing_rows, name, path, args,
                    table, losses)
        _free(device)
        if checks:
            table.guard(name, "float32 checks", float32_checks, name, path, adapter_dir, args,
                        table)
            _free(device)
        table.guard(name, "transformers + peft", peft_row, name, path, adapter_dir, args,
                    table)
        _free(device)
    table.guard(name, "FSDP2", distributed_row, name, path, args, table)
    _free(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="engine on one GPU: Qwen3-shaped bases, bf16")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes and batches: a smoke check of the code path")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device (torch.cuda.is_available() is False); run it on a "
              "machine with a GPU, or `--device cpu --small` for a smoke check",
              file=sys.stderr)
        return NO_CUDA_EXIT
    shapes = SMALL_SHAPES if args.small else SHAPES
    args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    args.rows, args.length, args.tenant_length = (2, 64, 32) if args.small else (8, 2048, 512)
    args.mixed_lengths = (8, 64) if args.small else (64, 2048)
    # The smoke run's 2 x 64 passes go in pieces, as the 4B shape's are expected to on a GPU.
    args.pass_tokens = 3 * args.length // 2 if args.small else AUTO_PASS_TOKENS
    args.steps = 2 if args.small else 3
    dtype = getattr(torch, args.dtype)
    peak = matmul_peak_flops(device, dtype, 512 if args.small else 8192)
    versions = f"torch {torch.__version__}, transformers {_version('transformers')}, " \
               f"peft {_version('peft')}"
    print(f"{time.strftime('%Y-%m-%d')} device "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"{args.dtype}, measured matmul peak {peak / 1e12:.1f} TFLOP/s; {versions}",
          flush=True)
    table = Table(device, peak)
    for index, (name, shape) in enumerate(shapes.items()):
        with tempfile.TemporaryDirectory() as tmp:
            build_model(Path(tmp), shape, dtype, device)
            _free(device)
            bench_shape(name, Path(tmp), args, table, checks=index == 0)
    table.print(args)
    return CHECK_FAILED_EXIT if table.failed else 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(main())
