"""Engine benchmarks on the tiny model: overhead vs plain PEFT, merging, memory, packing.

Run: `.venv/bin/python -m bench.engine` (also part of `make bench`); `--only packing`
(repeatable) runs one section. Each section runs
both sides in this one process, side by side, and prints throughput ratios; memory is
measured in fresh subprocesses so each RSS figure starts from the same baseline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from bench.data import mixed_datums, random_datums
from bench.timing import best_per_call
from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.types import AdamParams, LoraSpec, LossSpec
from twinkle_server.scheduling.executor import FORWARD, EngineExecutor
from twinkle_server.scheduling.planning import default_token_budget
from twinkle_server.scheduling.scheduler import Op, Scheduler

CE = LossSpec("cross_entropy")
ADAM = AdamParams(learning_rate=1e-4)
SPEC = LoraSpec(rank=16, alpha=32, seed=0)


def overhead(engine: Engine, repeats: int = 5, rounds: int = 5) -> None:
    """forward_backward + optim_step, 8 x 256 tokens: engine vs transformers + peft, each
    path's best of `rounds` interleaved rounds of `repeats` steps (one path's rounds
    vary by up to 20% on this machine)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = random_datums(8, 256, engine.base.vocab_size)
    engine.add_adapter("overhead", SPEC)

    def engine_step():
        engine.forward_batch([ForwardRequest("overhead", batch, CE, True)])
        engine.optim_step("overhead", ADAM)

    with tempfile.TemporaryDirectory() as tmp:
        engine.save_weights("overhead", f"{tmp}/a")
        base = AutoModelForCausalLM.from_pretrained(engine.base.model_dir, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, f"{tmp}/a", is_trainable=True)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2),
                            eps=ADAM.eps)
    ids = torch.from_numpy(np.stack([d.input_ids for d in batch]))
    targets = torch.from_numpy(np.stack([d.loss_inputs["target_tokens"] for d in batch]))

    def peft_step():
        logits = peft_model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                 reduction="sum")
        loss.backward()
        opt.step()
        opt.zero_grad()

    tokens = 8 * 256
    best = best_per_call({"peft": peft_step, "engine": engine_step}, rounds, repeats,
                         warmup=True)
    peft_s, engine_s = best["peft"], best["engine"]
    engine.remove_adapter("overhead")
    print("overhead: forward_backward + optim_step, 8 x 256 tokens, rank 16 all-linear")
    print(f"  {'path':<22}{'s/step':>10}{'tokens/s':>12}")
    print(f"  {'transformers + peft':<22}{peft_s:>10.4f}{tokens / peft_s:>12.0f}")
    print(f"  {'twinkle engine':<22}{engine_s:>10.4f}{tokens / engine_s:>12.0f}")
    print(f"  engine / peft throughput: {peft_s / engine_s:.2f}x")


def merging(engine: Engine, adapters: int = 8) -> None:
    """8 adapters each sending forward_backward batches: merged vs timeshare scheduling,
    with the scheduler's default token budget per merged pass. Each mode's best of its
    interleaved rounds (run to run, one mode alone varies by 10-30% on this machine);
    small batches get more steps and rounds, since one of their rounds lasts a second."""
    ids = [f"m{i}" for i in range(adapters)]
    for adapter_id in ids:
        engine.add_adapter(adapter_id, SPEC)
    budget = default_token_budget(engine.base.device.type)
    print(f"merging: {adapters} adapters, merge budget {budget} tokens")
    print(f"  {'batch per adapter':<20}{'ops each':>9}{'rounds':>7}{'timeshare tok/s':>16}"
          f"{'merged tok/s':>14}{'ratio':>8}")
    for n, length, steps, rounds in ((1, 128, 8, 7), (8, 512, 4, 3)):
        batch = random_datums(n, length, engine.base.vocab_size)
        speeds = {}
        for mode in ("timeshare", "merged") * rounds:
            sched = Scheduler(EngineExecutor(engine), mode=mode, token_budget=budget)
            for adapter_id in ids:
                sched.register_model(adapter_id)
            start = time.perf_counter()
            futures = [sched.submit(Op(a, s, "forward_backward", FORWARD, n * length,
                                       ForwardRequest(a, batch, CE, True)))
                       for s in range(steps) for a in ids]
            sched.start()
            for f in futures:
                f.result()
            elapsed = time.perf_counter() - start
            sched.stop()
            speeds[mode] = max(speeds.get(mode, 0.0), adapters * steps * n * length / elapsed)
        label = f"{n} x {length}"
        print(f"  {label:<20}{steps:>9}{rounds:>7}{speeds['timeshare']:>16.0f}"
              f"{speeds['merged']:>14.0f}{speeds['merged'] / speeds['timeshare']:>7.2f}x")
    for adapter_id in ids:
        engine.remove_adapter(adapter_id)


def pass_sizes(engine: Engine, rounds: int = 8) -> None:
    """One merged pass of k ops against the same k ops one pass each, by merged size:
    where merging stops paying on this device (what the merge budget is set from)."""
    print("merged pass vs one pass per op (forward_backward, distinct adapters):")
    print(f"  {'ops x batch':<16}{'merged tokens':>14}{'merged / separate':>20}")
    for ops, n, length in ((8, 1, 128), (4, 2, 128), (2, 4, 256), (4, 4, 256), (2, 4, 512),
                           (2, 8, 512)):
        names = [f"p{i}" for i in range(ops)]
        for name in names:
            engine.add_adapter(name, SPEC)
        batch = random_datums(n, length, engine.base.vocab_size)
        requests = [ForwardRequest(name, batch, CE, True) for name in names]
        best = best_per_call({
            "separate": lambda ops=requests: [engine.forward_batch([op]) for op in ops],
            "merged": lambda ops=requests: engine.forward_batch(ops)}, rounds)
        for name in names:
            engine.remove_adapter(name)
        print(f"  {f'{ops} x {n} x {length}':<16}{ops * n * length:>14}"
              f"{best['separate'] / best['merged']:>19.2f}x")


def packing(engine: Engine, tenants: int = 8, per_tenant: int = 2, rounds: int = 7) -> None:
    """One merged forward_backward pass of `tenants` adapters, packed (the default) vs
    padded (`--packing off`): real tokens per second, each path's best of `rounds`
    interleaved rounds. Datums of lengths uniform in 32..1024 and in 32..512, then every
    datum 528 tokens (the first's mean, so padded computes no padding: packing must not
    cost there)."""
    ids = [f"k{i}" for i in range(tenants)]
    for adapter_id in ids:
        engine.add_adapter(adapter_id, SPEC)
    vocab = engine.base.vocab_size
    mixed = [mixed_datums(per_tenant, 32, 1024, vocab, seed=i) for i in range(tenants)]
    shorter = [mixed_datums(per_tenant, 32, 512, vocab, seed=i) for i in range(tenants)]
    uniform = [random_datums(per_tenant, 528, vocab, seed=i) for i in range(tenants)]
    print(f"packing: {tenants} adapters x {per_tenant} datums, one merged forward_backward "
          f"pass, best of {rounds} interleaved rounds")
    print(f"  {'datum lengths':<20}{'real tokens':>12}{'padded positions':>18}"
          f"{'padded tok/s':>14}{'packed tok/s':>14}{'ratio':>8}")
    previous = engine.packing
    for label, batches in (("uniform 32..1024", mixed), ("uniform 32..512", shorter),
                           ("all 528", uniform)):
        requests = [ForwardRequest(a, batch, CE, True) for a, batch in zip(ids, batches,
                                                                            strict=True)]
        lengths = [d.num_tokens for batch in batches for d in batch]
        real, padded_positions = sum(lengths), len(lengths) * max(lengths)

        def run(packed: bool, requests=requests) -> None:
            engine.packing = packed
            engine.forward_batch(requests)

        best = best_per_call({"padded": lambda: run(False), "packed": lambda: run(True)},
                             rounds, warmup=False)
        print(f"  {label:<20}{real:>12}{padded_positions:>18}{real / best['padded']:>14.0f}"
              f"{real / best['packed']:>14.0f}{best['padded'] / best['packed']:>7.2f}x")
    engine.packing = previous
    for adapter_id in ids:
        engine.remove_adapter(adapter_id)


_MEMORY_CHILD = """
import json, sys
from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.types import AdamParams, LoraSpec, LossSpec
from bench.data import random_datums
engine = Engine.load('tiny')
n = int(sys.argv[1])
batch = random_datums(1, 64, engine.base.vocab_size)
state = 0
for i in range(n):
    engine.add_adapter(f'a{i}', LoraSpec(rank=16, alpha=32, seed=i))
    engine.forward_batch([ForwardRequest(f'a{i}', batch, LossSpec('cross_entropy'), True)])
    engine.optim_step(f'a{i}', AdamParams())
    state += engine.adapter_info(f'a{i}')['state_bytes']
if n == 0:
    # Same working set as the adapters' run (one training step), none of their state kept.
    engine.add_adapter('probe', LoraSpec(rank=16, alpha=32, seed=0))
    engine.forward_batch([ForwardRequest('probe', batch, LossSpec('cross_entropy'), True)])
    engine.optim_step('probe', AdamParams())
    engine.remove_adapter('probe')
import gc; gc.collect()
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork+exec.
hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))
print(json.dumps({'rss': int(hwm.split()[1]) * 1024, 'state': state}))
"""


def memory(adapters: int = 16) -> None:
    """Peak RSS with 16 adapters (r=16, all-linear, AdamW state) vs the base alone.

    The base-only run also takes one training step (with a throwaway adapter), so both
    peaks hold the same activation working set and the difference is adapter state.
    """
    def run(n: int) -> dict:
        out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(n)], check=True,
                             capture_output=True, text=True, env=os.environ)
        return json.loads(out.stdout.strip().splitlines()[-1])

    base, full = run(0), run(adapters)
    extra = full["rss"] - base["rss"]
    print(f"memory: {adapters} adapters, rank 16, all-linear, with AdamW state")
    print(f"  base only (one step) peak RSS{base['rss'] / 2**20:8.1f} MiB")
    print(f"  with {adapters} adapters peak RSS    {full['rss'] / 2**20:8.1f} MiB")
    print(f"  adapters' state (w+g+m+v)    {full['state'] / 2**20:8.1f} MiB")
    print(f"  extra RSS / state bytes      {extra / max(full['state'], 1):8.2f}x")
    print(f"  {adapters} separate processes     {adapters * base['rss'] / 2**20:8.1f} MiB "
          "(one base model each, before their adapters)")


_TRAINING_MEMORY_CHILD = """
import gc, json, sys, time
import numpy as np
import torch
from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.types import Datum, LoraSpec, LossSpec
path, checkpointing, n, length = sys.argv[1], sys.argv[2] == 'on', *map(int, sys.argv[3:5])
# An engine from before issue 17 takes no activation_checkpointing argument, nor a pass cap.
kwargs = {'activation_checkpointing': True} if checkpointing else {}
if len(sys.argv) > 5:
    from twinkle_server.engine.types import EngineLimits
    kwargs['limits'] = EngineLimits(max_pass_tokens=int(sys.argv[5]))
engine = Engine.load(path, **kwargs)
engine.add_adapter('a', LoraSpec(rank=16, alpha=32, seed=0))
vocab = engine.base.vocab_size
rng = np.random.default_rng(0)
batch = []
for _ in range(n):
    ids = rng.integers(3, vocab, length + 1)
    batch.append(Datum(ids[:-1], {'target_tokens': ids[1:],
                                  'weights': np.ones(length, np.float32)}))
gc.collect()
def status(key):
    line = next(l for l in open('/proc/self/status') if l.startswith(key + ':'))
    return int(line.split()[1]) * 1024
before = status('VmRSS')
# Reset the peak to the current RSS (Linux: clear_refs 5), so the peak is this pass's.
open('/proc/self/clear_refs', 'w').write('5')
start = time.perf_counter()
out = engine.forward_batch([ForwardRequest('a', batch, LossSpec('cross_entropy'), True)])[0]
seconds = time.perf_counter() - start
print(json.dumps({'before': before, 'peak': status('VmHWM'), 'seconds': seconds,
                  'loss': float(out.loss)}))
"""


def _save_random(config, out: str) -> str:
    """A model of `config` with random weights (seed 0) written to `out` with the tiny
    model's tokenizer files beside it; returns `out`."""
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from twinkle_server.engine.tiny_model import build_tiny_model

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in Path(build_tiny_model()).iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out)
    return out


def _random_qwen3(out: str, vocab: int, hidden: int, layers: int, intermediate: int,
                  heads: int) -> str:
    """The tiny model's tokenizer on a random Qwen3 of this shape (written to `out`)."""

    from transformers import AutoConfig

    from twinkle_server.engine.tiny_model import build_tiny_model

    tiny = build_tiny_model()
    config = AutoConfig.from_pretrained(tiny)
    config.update({"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
                   "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": max(1, heads // 2), "head_dim": hidden // heads,
                   "layer_types": ["full_attention"] * layers})
    return _save_random(config, out)


def training_memory(before: str | None = None, n: int = 4, length: int = 1024) -> None:
    """Peak RSS rise of ONE forward_backward of 4 x 1024 tokens (rank 16 all-linear), each
    in a fresh process: the rise from the RSS just before the pass to its peak.

    Two random Qwen3 bases: a 151,936-token vocabulary on a small body (hidden 64, 2
    layers), where the output layer's logits dominate, and the tiny vocabulary on a wider
    body (hidden 512, 8 layers), where the decoder layers' activations do; each with
    activation checkpointing off and on. `before`: the root of a checkout from before
    issue 17 (`git worktree add /tmp/before <commit>`), whose engine computes the
    whole pass's logits, run on the same models for the first rows.
    """
    shapes = {"vocab 151936, hidden 64, 2 layers": (151_936, 64, 2, 192, 4),
              "vocab 4096, hidden 512, 8 layers": (4096, 512, 8, 1536, 8)}
    print(f"training memory: one forward_backward, {n} x {length} tokens, rank 16 "
          "all-linear, peak RSS rise in a fresh process")
    print(f"  {'random Qwen3':<36}{'engine':<34}{'RSS before':>11}{'rise':>11}{'s/pass':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, shape in shapes.items():
            path = _random_qwen3(f"{tmp}/{shape[0]}-{shape[1]}", *shape)
            runs = [("full logits (before issue 17)", before, "off")] if before else []
            runs += [("chunked", None, "off"), ("chunked + activation ckpt", None, "on")]
            for name, root, checkpointing in runs:
                env = {**os.environ, "PYTHONPATH": root} if root else os.environ
                out = subprocess.run([sys.executable, "-c", _TRAINING_MEMORY_CHILD, path,
                                      checkpointing, str(n), str(length)], check=True,
                                     capture_output=True, text=True, env=env, cwd=root)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                rise = got["peak"] - got["before"]
                print(f"  {label:<36}{name:<34}{got['before'] / 2**30:>8.2f} GiB"
                      f"{rise / 2**30:>7.2f} GiB{got['seconds']:>8.2f}")


def pass_pieces(n: int = 16, length: int = 1024, cap: int = 4096) -> None:
    """One forward_backward of `n` x `length` tokens on the wider random Qwen3 (vocab 4096,
    hidden 512, 8 layers): in one pass, in pieces of `cap` tokens (`--max-pass-tokens`),
    and in one pass with activation checkpointing (the trade `--activation-checkpointing
    auto` makes: pieces and checkpointing each run one more forward). Peak RSS rise and
    seconds, each in a fresh process, the three alternated twice."""
    print(f"pass pieces: one forward_backward, {n} x {length} tokens, rank 16 all-linear, "
          "wider random Qwen3, peak RSS rise in a fresh process")
    print(f"  {'run':<28}{'RSS before':>11}{'rise':>11}{'s/pass':>8}{'loss':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        path = _random_qwen3(f"{tmp}/wide", 4096, 512, 8, 1536, 8)
        for _ in range(2):
            for name, checkpointing, pieces in (("one pass", "off", 0),
                                                (f"pieces of {cap}", "off", cap),
                                                ("one pass, checkpointed", "on", 0)):
                out = subprocess.run([sys.executable, "-c", _TRAINING_MEMORY_CHILD, path,
                                      checkpointing, str(n), str(length), str(pieces)],
                                     check=True, capture_output=True, text=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                rise = got["peak"] - got["before"]
                print(f"  {name:<28}{got['before'] / 2**30:>8.2f} GiB{rise / 2**30:>7.2f} GiB"
                      f"{got['seconds']:>8.2f}{got['loss']:>12.4f}")


def _wider_config() -> Any:
    """The tiny model's config made wider: hidden 512, 8 layers, ~40M parameters."""
    from transformers import AutoConfig

    from twinkle_server.engine.tiny_model import build_tiny_model

    config = AutoConfig.from_pretrained(build_tiny_model())
    config.update({"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                   "layer_types": ["full_attention"] * 8})
    return config


def _wider_base(out: str) -> str:
    """The tiny model's tokenizer on a wider random Qwen3 (`_wider_config`): closer to
    where base compute, not Python, dominates a pass."""
    return _save_random(_wider_config(), out)


def _windowed_base(out: str, window: int | None) -> str:
    """The wider base with a sliding window of `window` positions on every other layer,
    as gpt-oss alternates them (None: the same weights with every layer full attention,
    what the decode pool held for a window before it kept only the window)."""
    config = _wider_config()
    if window is not None:
        config.update({"use_sliding_window": True, "sliding_window": window,
                       "layer_types": ["sliding_attention", "full_attention"] * 4})
    return _save_random(config, out)


def _hybrid_base(out: str) -> str:
    """The tiny model's tokenizer on a random Qwen3.5 text hybrid of the wider base's
    sizes (hidden 512, 8 layers: 6 Gated DeltaNet linear attention, 2 full attention, as
    Qwen3.5 alternates them 3 to 1), for the decode pool's recurrent states."""

    from transformers import AutoTokenizer, Qwen3_5TextConfig

    from twinkle_server.engine.tiny_model import build_tiny_model

    tiny = build_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        layer_types=["linear_attention"] * 3 + ["full_attention"]
        + ["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        dtype="float32")
    return _save_random(config, out)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="engine benchmarks")
    on_engine = {"overhead": overhead, "pass_sizes": pass_sizes, "merging": merging,
                 "packing": packing}
    sections = ("memory", "training_memory", "pass_pieces", *on_engine)
    parser.add_argument("--base", choices=("tiny", "wide"), default="tiny",
                        help="tiny: the embedded model; wide: a ~40M-parameter random Qwen3")
    parser.add_argument("--only", choices=sections, action="append",
                        help="run only this section (repeatable); default: all")
    parser.add_argument("--before", metavar="ROOT",
                        help="training_memory: also run the engine of the checkout at ROOT "
                             "(from before issue 17: whole-pass logits)")
    args = parser.parse_args()
    chosen = args.only or sections
    if args.base == "wide":
        with tempfile.TemporaryDirectory() as tmp:
            engine = Engine.load(_wider_base(tmp))
            print(f"base: wide random Qwen3, {sum(p.numel() for p in engine.base.model.parameters())} "
                  "parameters")
            for name, section in on_engine.items():
                if name in chosen:
                    section(engine)
        return
    engine = Engine.load("tiny")
    print(f"device {engine.base.device}, dtype {engine.base.dtype}, "
          f"torch threads {torch.get_num_threads()}")
    if "memory" in chosen:
        memory()
    if "training_memory" in chosen:
        training_memory(args.before)
    if "pass_pieces" in chosen:
        pass_pieces()
    for name, section in on_engine.items():
        if name in chosen:
            section(engine)


if __name__ == "__main__":
    main()
