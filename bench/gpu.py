"""GPU benchmark: throughput, model FLOPs utilisation and peak memory of the engine's
training step on Qwen3-0.6B- and Qwen3-4B-shaped bases in bf16, against a plain
transformers + peft loop; then the GPU tests (`tests/gpu/`, the engine's numerics on the
device).

Run: `python3 -m bench.gpu 2>&1 | tee gpu.txt` on a machine with one CUDA device
(sized to run unattended in under 8 minutes, the tests adding about one more minute by
estimate; `.venv/bin/python` where the venv is there); `--device cpu --small` is a smoke
check of the same code path on tiny shapes (seconds), `--no-tests` leaves the tests out.
Not part of `make bench` (which runs on CPU). Exits 2 when no CUDA device is present, 1 when a row
could not run or a GPU test failed, else 0.

For each shape, a random-initialised model with the published Qwen3 sizes (no download,
`bench.gpu_shapes`) is saved with the tiny model's tokenizer to a temp dir, then each row
loads it afresh:

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

After the table, `python -m pytest -m gpu tests/gpu` runs in a subprocess of this
interpreter, on this run's device and sizes (`TWINKLE_GPU_TESTS_DEVICE`,
`TWINKLE_GPU_TESTS_SMALL`): packed == padded logprobs in bf16 (flash sdpa) and float32
(memory-efficient sdpa), a packed datum's logprobs whatever another datum's tokens are,
and activation checkpointing on and off training alike; their tolerances, and why, are
in `tests/gpu/test_cuda_numerics.py`.

Model FLOPs come from the config (`bench.flops.ModelFlops`, the count `bench.limit` uses
too): the linear layers (the output layer's included) and the rank-16 adapter's, forward
and backward (to the inputs; weight gradients for the adapter only, the base being
frozen), and causal attention per attended position; the forward that activation
checkpointing, or a pass in pieces, runs again is not counted, so MFU is the useful
share.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.data import mixed_datums, random_datums
from bench.flops import ModelFlops
from bench.gpu_shapes import (
    ADAM,
    CE,
    SPEC,
    TENANTS,
    GpuRun,
    build_model,
    free,
    load_engine,
    one_piece,
    run_batch,
    train_steps,
)
from twinkle_server.engine.types import AUTO_PASS_TOKENS, Datum

COLLECTIVE_TIMEOUT_S = 120
"""Short of the device call's 10 minutes: a hung nccl collective fails the FSDP2 row."""
NO_CUDA_EXIT = 2
FAILED_EXIT = 1
REPO_ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = "tests/gpu"


@dataclass
class Table:
    """The rows of one run, printed as they come and again at the end."""

    device: torch.device
    peak_flops: float
    rows: list[tuple[str, str, float, float, float | None]] = field(default_factory=list)
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

    def print(self, run: GpuRun) -> None:
        print(f"rank 16 all-linear, forward_backward (+ optim_step for the {run.rows} x "
              f"{run.length} rows), median of {run.steps} timed steps after one warmup")
        print(f"  {'model':<12}{'run':<44}{'tokens/s':>11}{'MFU':>8}{'peak GiB':>10}")
        for row in self.rows:
            print(f"  {_format_row(row)}")
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


def step_flops(config, datums: list[Datum]) -> float:
    """Model FLOPs of one forward_backward over `datums`, each attending within itself
    (`bench.flops`)."""
    flops = ModelFlops.of(config, SPEC.rank)
    return sum(flops.train_sequence(d.num_tokens) for d in datums)


def _peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        free(device)
        torch.cuda.reset_peak_memory_stats(device)


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


def describe_memory(name: str, engine, run: GpuRun, label: str) -> None:
    """Print the pass cap a server would pick here and the engine's headroom estimates:
    for a piece of that cap, and for the bench's whole pass as one piece."""
    from twinkle_server.engine import memory

    base, tokens = engine.base, run.rows * run.length
    whole = memory.pass_headroom_bytes(base.config, base.dtype, base.vocab_size, tokens,
                                       engine.activation_checkpointing)
    auto = memory.auto_checkpointing(base.config, base.dtype, base.vocab_size,
                                     base.device.type, memory.available_memory_bytes(
                                         base.device), run.length)
    picked = ("what --max-pass-tokens 0 picks here" if run.pass_tokens == AUTO_PASS_TOKENS
              else "the smoke run's")
    print(f"{name} ({label}): passes run in pieces of at most "
          f"{engine.limits.max_pass_tokens} tokens ({picked}), "
          f"pass headroom estimate {engine.pass_headroom_bytes / 2**30:.2f} GiB; "
          f"{whole / 2**30:.2f} GiB for {run.rows} x {run.length} tokens in one piece; "
          f"--activation-checkpointing auto would turn it {'on' if auto else 'off'}",
          flush=True)


def engine_label(engine, run: GpuRun, extra: str = "") -> str:
    """`engine R x L`, the pass cap when the pass runs in pieces, and `extra`."""
    cap = engine.limits.max_pass_tokens
    pieces = f", pieces <= {cap}" if cap < run.rows * run.length else ""
    return f"engine {run.rows} x {run.length}{pieces}{extra}"


def engine_rows(name: str, path: Path, adapter_dir: str, run: GpuRun, table: Table) -> None:
    """The plain engine's rows; saves the trained adapter to `adapter_dir` (the peft
    row's)."""
    engine = load_engine(path, run)
    add_measured_adapter(engine, name, "bench")
    describe_memory(name, engine, run, "activation checkpointing off")
    try:
        _engine_rows(name, engine, run, table)
    finally:
        engine.save_weights("bench", adapter_dir)


def _engine_rows(name: str, engine, run: GpuRun, table: Table) -> None:
    from twinkle_server.engine.engine import ForwardRequest

    config, vocab = engine.base.config, engine.base.vocab_size
    batch = random_datums(run.rows, run.length, vocab)
    table.time(name, engine_label(engine, run), train_steps(engine, "bench", batch, []),
               run.rows * run.length, step_flops(config, batch), run.steps)
    # The same pass in one piece: what the headroom estimate for it is calibrated by.
    with one_piece(engine):
        table.time(name, f"engine {run.rows} x {run.length}, one piece",
                   train_steps(engine, "bench", batch, []), run.rows * run.length,
                   step_flops(config, batch), run.steps)

    tenants = [f"t{i}" for i in range(TENANTS)]
    for tenant in tenants:
        add_measured_adapter(engine, name, tenant)
    small = [random_datums(1, run.tenant_length, vocab, seed=i) for i in range(TENANTS)]
    requests = [ForwardRequest(t, d, CE, True) for t, d in zip(tenants, small, strict=True)]
    flops = sum(step_flops(config, d) for d in small)
    tokens = TENANTS * run.tenant_length
    table.time(name, f"{TENANTS} tenants x 1 x {run.tenant_length} merged",
               lambda: run_batch(engine, requests), tokens, flops, run.steps)
    table.time(name, f"{TENANTS} tenants x 1 x {run.tenant_length} timeshare",
               lambda: [run_batch(engine, [r]) for r in requests], tokens, flops,
               run.steps)

    low, high = run.mixed_lengths
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
                   run.steps)
    engine.packing = True


def checkpointing_rows(name: str, path: Path, run: GpuRun, table: Table) -> None:
    """The engine row with `--activation-checkpointing on`."""
    engine = load_engine(path, run, activation_checkpointing=True)
    add_measured_adapter(engine, name, "bench")
    describe_memory(name, engine, run, "activation checkpointing on")
    batch = random_datums(run.rows, run.length, engine.base.vocab_size)
    table.time(name, engine_label(engine, run, ", activation ckpt"),
               train_steps(engine, "bench", batch, []), run.rows * run.length,
               step_flops(engine.base.config, batch), run.steps)


def peft_row(name: str, path: Path, adapter_dir: str, run: GpuRun, table: Table) -> None:
    """The same step as a plain transformers + peft loop (full logits, no packing)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    device = torch.device(run.device)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, run.dtype)
                                                ).to(device)
    batch = random_datums(run.rows, run.length, int(base.config.vocab_size))
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

    table.time(name, f"transformers + peft {run.rows} x {run.length}", step,
               run.rows * run.length, step_flops(base.config, batch), run.steps)


def distributed_row(name: str, path: Path, run: GpuRun, table: Table) -> None:
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
        parallel = Parallel.init(placement_from_env(run.device),
                                 timeout_s=COLLECTIVE_TIMEOUT_S)
        engine = load_engine(path, run, parallel=parallel)
        add_measured_adapter(engine, name, "bench")
        batch = random_datums(run.rows, run.length, engine.base.vocab_size)
        table.time(name, engine_label(engine, run, ", FSDP2 1 rank"),
                   train_steps(engine, "bench", batch, []), run.rows * run.length,
                   step_flops(engine.base.config, batch), run.steps)
    finally:
        if parallel is not None:
            parallel.close()
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key)


def sampling_row(name: str, path: Path, run: GpuRun, table: Table) -> None:
    """The RL group pattern through the decode pool (continuous batching): 8 prompts x
    8 samples x 128 new tokens (2 x 2 x 8 in the smoke run), at temperature 1 with EOS
    ignored, one LoRA adapter. Tokens/s counts sampled tokens; the FLOPs are the prefills'
    and the decode steps' forwards (`bench.flops`)."""
    from twinkle_server.engine.types import SampleRequest, SamplingParams

    engine = load_engine(path, run)
    add_measured_adapter(engine, name, "rl")
    prompts, samples, new = (2, 2, 8) if run.small else (8, 8, 128)
    prompt_len = 16 if run.small else 256
    rng = np.random.default_rng(0)
    vocab = engine.base.vocab_size
    requests = [SampleRequest("rl", None, rng.integers(0, vocab, prompt_len), samples,
                              SamplingParams(max_tokens=new, seed=i, ignore_eos=True))
                for i in range(prompts)]

    def group() -> None:
        done = dict(engine.decode(requests, list(range(prompts)), 0.5))
        while len(done) < prompts:
            done.update(engine.decode([], [], 0.5))
        for out in done.values():
            if isinstance(out, Exception):
                raise out

    tokens = prompts * samples * new
    flops = prompts * ModelFlops.of(engine.base.config, SPEC.rank).sampled(prompt_len,
                                                                            [new] * samples)
    table.time(name, f"sample {prompts} x {samples} x {new} (RL group, decode pool)", group,
               tokens, flops, run.steps)


def bench_shape(name: str, path: Path, run: GpuRun, table: Table) -> None:
    """Every row of one shape, each function on a fresh load, freed before the next
    (engines hold reference cycles: `free` collects them). A function that fails is
    reported and the next one runs."""
    device = torch.device(run.device)
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dir = f"{tmp}/adapter"
        table.guard(name, "engine rows", engine_rows, name, path, adapter_dir, run, table)
        free(device)
        table.guard(name, "activation checkpointing", checkpointing_rows, name, path, run,
                    table)
        free(device)
        table.guard(name, "transformers + peft", peft_row, name, path, adapter_dir, run,
                    table)
        free(device)
        table.guard(name, "sampling", sampling_row, name, path, run, table)
        free(device)
    table.guard(name, "FSDP2", distributed_row, name, path, run, table)
    free(device)


def split_rows(device: torch.device, run: GpuRun) -> bool:
    """The RL step with sampler ranks beside trainer ranks against colocated ranks, one
    GPU per rank, through a launched server (`bench.split.rl_step`, the tiny model); it
    needs 2 GPUs, and says so on a machine with fewer. Returns False when it failed."""
    from bench import split

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and gpus < 2:
        print(f"RL step, split vs colocated: not run, it needs 2 GPUs (one per rank); this "
              f"machine has {gpus}", flush=True)
        return True
    try:
        split.print_rl_step(ranks=2, device=device.type, steps=2 if run.small else run.steps)
    except Exception as exc:
        print(f"RL step, split vs colocated: failed: {type(exc).__name__}: {exc}", flush=True)
        return False
    return True


def run_gpu_tests(run: GpuRun) -> int:
    """`pytest -m gpu tests/gpu` in a subprocess of this interpreter, on this run's device
    and sizes, its output going to ours; returns its exit status."""
    if importlib.util.find_spec("pytest") is None:
        print(f"bench.gpu: pytest is not installed for {sys.executable}; the GPU tests did "
              "not run", file=sys.stderr)
        return FAILED_EXIT
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-s", "-p", "no:cacheprovider",
               GPU_TESTS]
    env = {**os.environ, "TWINKLE_GPU_TESTS_DEVICE": run.device,
           "TWINKLE_GPU_TESTS_SMALL": "1" if run.small else "0"}
    print(f"{_clock()} GPU tests: {' '.join(command[1:])}", flush=True)
    return subprocess.run(command, cwd=REPO_ROOT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="the engine's training step on Qwen3-shaped bases (bf16 on one CUDA "
                    "device): tokens/s, MFU and peak memory, then the GPU tests "
                    "(pytest -m gpu tests/gpu)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes and batches: a smoke check of the code path")
    parser.add_argument("--tests", action=argparse.BooleanOptionalAction, default=True,
                        help="run the GPU tests after the table (default: on)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device (torch.cuda.is_available() is False); run it on a "
              "machine with a GPU, or `--device cpu --small` for a smoke check",
              file=sys.stderr)
        return NO_CUDA_EXIT
    run = GpuRun.of(args.device, args.small)
    dtype = getattr(torch, run.dtype)
    peak = matmul_peak_flops(device, dtype, 512 if run.small else 8192)
    versions = f"torch {torch.__version__}, transformers {_version('transformers')}, " \
               f"peft {_version('peft')}"
    print(f"{time.strftime('%Y-%m-%d')} device "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"{run.dtype}, measured matmul peak {peak / 1e12:.1f} TFLOP/s; {versions}",
          flush=True)
    table = Table(device, peak)
    for name, shape in run.shapes.items():
        with tempfile.TemporaryDirectory() as tmp:
            build_model(Path(tmp), shape, dtype, device)
            free(device)
            bench_shape(name, Path(tmp), run, table)
    table.print(run)
    failed = bool(table.failures)
    if not split_rows(device, run):
        failed = True
    if args.tests:
        free(device)
        failed = run_gpu_tests(run) != 0 or failed
    return FAILED_EXIT if failed else 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(main())
