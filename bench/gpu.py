"""GPU benchmark (issue 17): the engine on Qwen3-0.6B- and Qwen3-4B-shaped bases, bf16.

Run: `.venv/bin/python -m bench.gpu` on a machine with one CUDA device (unattended, under
8 minutes); `.venv/bin/python -m bench.gpu --device cpu --small` is a smoke check of the
same code path on tiny shapes (seconds). Not part of `make bench` (which runs on CPU).

For each shape: a random-initialised model with the published Qwen3 sizes (no download)
is saved with the tiny model's tokenizer to a temp dir and loaded by `Engine.load`. Rows:
forward_backward + optim_step of 8 x 2048 tokens, rank 16 all-linear, through the engine
and through a plain transformers + peft loop on the same model and data; then 8 tenants
each sending 1 x 512, merged (one `Engine.forward_batch` of 8 requests) vs timeshare (8
calls); and the engine's step again under torch.distributed with one rank (nccl; issue
16's FSDP2 path, `--nproc-per-node`). Tokens/s, model FLOPs utilisation against this device's bf16 matmul peak measured
here (a large matmul timed with CUDA events), and peak memory
(`torch.cuda.max_memory_allocated`) beside the engine's own pass headroom estimate
(`engine.memory`). Exits 2 when no CUDA device is present.

Model FLOPs per token, frozen base + LoRA: forward 2N and backward 2N (input gradients
only; no weight gradients for the base), N the linear layers' weights (lm_head included),
plus causal attention 6 x layers x Q x seq (QK^T and AV forward, twice that backward, half
the positions masked). LoRA's own FLOPs (rank 16) are under 1% and not counted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from twinkle_server.engine.types import AdamParams, Datum, EngineLimits, LoraSpec, LossSpec

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
                  tie_word_embeddings=False),
}
CE = LossSpec("cross_entropy")
ADAM = AdamParams(learning_rate=1e-4)
SPEC = LoraSpec(rank=16, alpha=32, seed=0)
NO_CUDA_EXIT = 2


def _datums(n: int, length: int, vocab: int, seed: int = 0) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, vocab, length + 1)
        out.append(Datum(ids[:-1], {"target_tokens": ids[1:],
                                    "weights": np.ones(length, np.float32)}))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device, steps: int) -> float:
    """Seconds per call: one unmeasured call, then the mean of `steps`."""
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / steps


def matmul_peak_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an `n x n` matmul in `dtype` (CUDA events on a GPU), best of 3 rounds."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    iters, best = 10, 0.0
    for _ in range(4):
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
        best = max(best, 2 * n**3 * iters / seconds)  # the first round is the warmup
    return best


def flops_per_token(config, seq: int) -> float:
    """Model FLOPs of one trained token (module docstring)."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    linear = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter) + h * config.vocab_size
    return 4 * linear + 6 * layers * q * seq


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
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_shape(name: str, path: Path, args, peak_flops: float, rows: list) -> None:
    """The engine rows, then (the engine freed) the transformers + peft row."""
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        mfu = engine_rows(name, path, f"{tmp}/a", args, peak_flops, rows)
        _free(device)
        peft_row(name, path, f"{tmp}/a", args, mfu, rows)
        _free(device)
        distributed_row(name, path, args, mfu, rows)
        _free(device)


def engine_rows(name: str, path: Path, adapter_dir: str, args, peak_flops: float,
                rows: list) -> Callable[[float, int], float]:
    """Engine rows; saves the trained adapter to `adapter_dir`; returns the MFU function."""
    import twinkle_server.engine.engine as engine_module
    from twinkle_server.engine import memory
    from twinkle_server.engine.engine import Engine, ForwardRequest
    from twinkle_server.engine.errors import EngineError, ResourceExhausted

    device, n, length = torch.device(args.device), args.rows, args.length
    limits = EngineLimits(max_adapters=16, max_seq_len=length, max_batch_tokens=n * length)
    engine = Engine.load(str(path), device=args.device, dtype=args.dtype, limits=limits)
    config = engine.base.config
    vocab = config.vocab_size
    headroom = engine.pass_headroom_bytes / 2**30
    try:
        engine.add_adapter("bench", SPEC)
        note = "admitted"
    except ResourceExhausted as exc:
        # Run anyway: the measured peak below is what calibrates the estimate.
        note = f"REFUSED ({exc})"
        real = engine_module.available_memory_bytes
        engine_module.available_memory_bytes = lambda device: None
        try:
            engine.add_adapter("bench", SPEC)
        finally:
            engine_module.available_memory_bytes = real
    print(f"{name}: engine pass headroom estimate for {n} x {length} tokens "
          f"{headroom:.2f} GiB, {note}", flush=True)
    try:
        auto = memory.auto_pass_tokens(config, engine.base.dtype, config.vocab_size,
                                       device.type, engine_module.available_memory_bytes(
                                           device), length)
        print(f"{name}: a server here would run passes in pieces of at most {auto} tokens "
              "(--max-pass-tokens 0)", flush=True)
    except EngineError as exc:
        print(f"{name}: a server here would refuse to start: {exc}", flush=True)
    batch = _datums(n, length, vocab)
    tokens = n * length

    def mfu(seconds: float, seq: int, tokens: int = tokens) -> float:
        return flops_per_token(config, seq) * tokens / seconds / peak_flops

    def engine_step() -> None:
        out = engine.forward_batch([ForwardRequest("bench", batch, CE, True)])[0]
        if isinstance(out, Exception):
            raise out
        engine.optim_step("bench", ADAM)

    _reset_peak(device)
    base_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    seconds = _seconds(engine_step, device, args.steps)
    rows.append((name, f"engine {n} x {length}", tokens / seconds, mfu(seconds, length),
                 _peak(device)))
    if base_gib is not None:
        print(f"{name}: engine peak above weights + adapter {_peak(device) - base_gib:.2f} GiB "
              f"(estimate {headroom:.2f} GiB)", flush=True)

    # 8 tenants x 1 x 512: one merged pass of 8 requests vs 8 passes.
    tenants = [f"t{i}" for i in range(8)]
    for tenant in tenants:
        engine.add_adapter(tenant, SPEC)
    small = args.tenant_length
    requests = [ForwardRequest(t, _datums(1, small, vocab, seed=i), CE, True)
                for i, t in enumerate(tenants)]
    tenant_tokens = 8 * small
    for mode, step in (("merged", lambda: engine.forward_batch(requests)),
                       ("timeshare", lambda: [engine.forward_batch([r]) for r in requests])):
        _reset_peak(device)
        seconds = _seconds(step, device, args.steps)
        rows.append((name, f"8 tenants x 1 x {small} {mode}", tenant_tokens / seconds,
                     mfu(seconds, small, tenant_tokens), _peak(device)))
    engine.save_weights("bench", adapter_dir)
    return mfu


def distributed_row(name: str, path: Path, args, mfu: Callable[[float, int], float],
                    rows: list) -> None:
    """The engine's step under torch.distributed with one rank (nccl on CUDA, gloo on
    CPU): the FSDP2 path of `--nproc-per-node`, against the plain engine row above."""
    import socket

    from twinkle_server.engine.engine import Engine, ForwardRequest
    from twinkle_server.engine.parallel import Parallel, placement_from_env

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    parallel = Parallel.init(placement_from_env(args.device), timeout_s=600)
    try:
        n, length = args.rows, args.length
        limits = EngineLimits(max_adapters=16, max_seq_len=length, max_batch_tokens=n * length)
        engine = Engine.load(str(path), device=args.device, dtype=args.dtype, limits=limits,
                             parallel=parallel)
        engine.add_adapter("bench", SPEC)
        batch = _datums(n, length, engine.base.vocab_size)

        def step() -> None:
            out = engine.forward_batch([ForwardRequest("bench", batch, CE, True)])[0]
            if isinstance(out, Exception):
                raise out
            engine.optim_step("bench", ADAM)

        device = torch.device(args.device)
        _reset_peak(device)
        seconds = _seconds(step, device, args.steps)
        rows.append((name, f"engine {n} x {length}, FSDP2 1 rank", n * length / seconds,
                     mfu(seconds, length), _peak(device)))
    finally:
        parallel.close()
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key)


def peft_row(name: str, path: Path, adapter_dir: str, args,
             mfu: Callable[[float, int], float], rows: list) -> None:
    """The same step as a plain transformers + peft loop (full logits, no packing)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    batch = _datums(args.rows, args.length, int(base_vocab(path)))
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
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

    _reset_peak(device)
    label = f"transformers + peft {args.rows} x {args.length}"
    try:
        seconds = _seconds(step, device, args.steps)
        rows.append((name, label, args.rows * args.length / seconds, mfu(seconds, args.length),
                     _peak(device)))
    except torch.cuda.OutOfMemoryError:
        rows.append((name, f"{label} (out of memory)", float("nan"), float("nan"),
                     _peak(device)))


def base_vocab(path: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).vocab_size)


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
    args.steps = 2 if args.small else 3
    dtype = getattr(torch, args.dtype)
    peak = matmul_peak_flops(device, dtype, 512 if args.small else 8192)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"{args.dtype}, measured matmul peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    rows: list[tuple] = []
    for name, shape in shapes.items():
        with tempfile.TemporaryDirectory() as tmp:
            build_model(Path(tmp), shape, dtype, device)
            _free(device)
            bench_shape(name, Path(tmp), args, peak, rows)
    print(f"rank 16 all-linear, forward_backward (+ optim_step for the {args.rows} x "
          f"{args.length} rows), {args.steps} timed steps after one warmup")
    print(f"  {'model':<12}{'run':<36}{'tokens/s':>11}{'MFU':>8}{'peak GiB':>10}")
    for name, run, speed, util, peak_gib in rows:
        mem = f"{peak_gib:>10.2f}" if peak_gib is not None else f"{'n/a':>10}"
        print(f"  {name:<12}{run:<36}{speed:>11.0f}{util:>8.1%}{mem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
