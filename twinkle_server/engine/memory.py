"""Memory a training pass needs beyond the adapters' own state (the pass headroom), and
the memory free on a device (`available_memory_bytes`).

`Engine.add_adapter` refuses an adapter unless `adapter state + pass headroom <= free`,
where the pass headroom is the activation and logits memory of the LARGEST pass the
engine's limits allow: `EngineLimits.max_pass_tokens` tokens, since a larger pass runs
through the base in pieces of at most that many (`forward.PassLogprobs`), or with no such
cap `max_batch_tokens`; each datum at most `max_seq_len`, which attention below keeps
linear in. It is shared by every adapter (one
pass runs at a time, on the scheduler's one worker), so it is computed once per engine
and counted once, not per adapter: a request that fits the limits then cannot run the
device out of memory in its forward_backward.

How it is bounded, per token of a pass of T tokens (H hidden size, I intermediate size,
Q = heads x head_dim and K = kv_heads x head_dim the attention widths, d the model dtype's
bytes), for a Qwen3-style layer (other kinds, MoE, linear attention and Mamba, are
counted per layer by `engine.layer_kinds`):

    per layer   d x (4H + 6Q + K + 4I)            tensors autograd keeps for backward
              + 4 x (7H + 2Q + K + I)             float32 copies, when d < 4 (bf16, fp16)
    whole pass  T x (sum of layers + 3H x d) x ACTIVATION_MARGIN
              + 4 x min(T, chunk) x V x 4         one logits chunk's backward
                                                  (chunk = `logprobs.chunk_tokens(V)`)

The counts come from reading a Qwen3-style decoder layer with every linear LoRA-targeted
and the base frozen (autograd keeps a matmul's input only where the weight needs a
gradient, so the base projections keep nothing; the LoRA `A` matmuls keep theirs):
each RMSNorm keeps its input and its output feeds the LoRA `A`s (2H, twice: 4H); the
q/k norms keep their inputs (Q + K); sdpa keeps q, k and v repeated to the query heads,
and its output (4Q), and the o_proj LoRA its contiguous input (Q); the MLP keeps gate for
SiLU, SiLU(gate) and up for their product, and down's input (4I). On a bf16 base the
LoRA weights are float32 (`lora.LoraWeights`), so each targeted layer's input is cast up
and kept: q, k, v, gate and up cast the normed input separately (5H), o and down theirs
(Q + I); the RMSNorms upcast their inputs (2H + Q + K). Outside the layers, the final
norm's input and output and the last hidden states kept for the logprob chunks (3H).
With activation checkpointing each layer keeps only its input (H x d) and one layer at a
time is recomputed in backward: `(layers x H x d + one layer + 3H x d) x
CHECKPOINTED_MARGIN` per token (the largest layer for "one layer"), and never more than the
uncheckpointed bound.

`ACTIVATION_MARGIN` covers what the count leaves out: backward's transients (a layer's
activation gradients exist beside what it still keeps) and the allocator's slack.
Measured on CPU, float32, 2026-12-03 (2 loaded cores), one forward_backward of N tokens
(N/1024 datums of 1,024) in a fresh process, rank 16 all-linear: the peak RSS rise over
the RSS just before the pass (`bench.engine`'s training_memory child), its slope between
N = 1,024 and 4,096, less the logits (4 x 4,096 x 4 B = 64 KB a token, both vocabularies
fitting one chunk), against the count above without margin:

    per token, activations                          counted    measured   ratio
    tiny model (H 128, I 384, 4 layers)             46.5 KB    45.0 KB    0.97
    random Qwen3 (H 512, I 1536, 8 layers, Q 512)    366 KB     516 KB    1.41
    tiny, activation checkpointing                  14.8 KB     8.7 KB    0.59
    random Qwen3, activation checkpointing            67 KB     316 KB    4.7

Hence `ACTIVATION_MARGIN` 1.5. Checkpointed, the count under-states the wider model 4.7x
(the replayed layer's forward and backward transients, and freed blocks the CPU allocator
keeps in RSS), hence `CHECKPOINTED_MARGIN` 5, and a checkpointed bound is never above the
uncheckpointed one. A GPU pass (bf16, flash or memory-efficient sdpa) has not been
measured (no accelerator lent yet; `bench.gpu` prints the estimate beside the measured
peak): the float32-copies term is counted from the code, not measured.

Not covered: LoRA dropout (> 0 keeps a mask and a dropped copy of each targeted input);
`--packing off`, whose padded pass may hold more positions than tokens; an eager or math
attention kernel that materialises `[heads, n, n]` scores per datum.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from twinkle_server.engine import layer_kinds, logprobs
from twinkle_server.engine.errors import InvalidArgument

ACTIVATION_MARGIN = 1.5
"""Measured / counted activation bytes per token, rounded up (module docstring: 1.41 on
the wider random Qwen3, 0.97 on the tiny model)."""

CHECKPOINTED_MARGIN = 5.0
"""The same ratio with activation checkpointing on (4.7 measured on the wider model):
the replayed layer's transients are most of what a checkpointed pass holds."""

LOGITS_CHUNK_COPIES = 4
"""Float32 `[chunk, vocab]` tensors a logits chunk's backward holds at once: logits,
log-softmax and their two gradients (`engine.logprobs`)."""

_FLOAT32_BYTES = 4


def layer_elements(config: Any) -> list[tuple[int, int]]:
    """(elements in the model dtype, float32 elements) each decoder layer keeps for
    backward per token, read per layer kind (`engine.layer_kinds`: attention, dense MLP,
    MoE experts and shared experts, linear attention, Mamba); a kind or size the config
    does not give raises InvalidArgument naming it."""
    return layer_kinds.layer_elements(config)


def activation_bytes_per_token(config: Any, dtype: torch.dtype,
                               checkpointing: bool = False) -> int:
    """Activation bytes a training pass keeps per token, margin included (module docstring)."""
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    layers = [kept * dtype_bytes + (upcast * _FLOAT32_BYTES if dtype_bytes < 4 else 0)
              for kept, upcast in layer_elements(config)]
    hidden = int(layer_kinds.text_config(config).hidden_size)
    outside = 3 * hidden * dtype_bytes
    full = math.ceil((sum(layers) + outside) * ACTIVATION_MARGIN)
    if not checkpointing:
        return full
    # Each layer keeps its input; the largest is the one recomputed at a time.
    kept = len(layers) * hidden * dtype_bytes + max(layers) + outside
    return min(full, math.ceil(kept * CHECKPOINTED_MARGIN))


def logits_bytes(tokens: int, vocab_size: int) -> int:
    """One logits chunk's backward: `LOGITS_CHUNK_COPIES` float32 `[chunk, vocab]` tensors,
    the chunk no longer than the pass."""
    chunk = min(tokens, logprobs.chunk_tokens(vocab_size))
    return LOGITS_CHUNK_COPIES * chunk * vocab_size * _FLOAT32_BYTES


def pass_headroom_bytes(config: Any, dtype: torch.dtype, vocab_size: int, tokens: int,
                        checkpointing: bool = False) -> int:
    """Memory the largest training pass of `tokens` tokens needs besides the weights and
    the adapters' state: its activations plus one logits chunk's backward."""
    return (tokens * activation_bytes_per_token(config, dtype, checkpointing)
            + logits_bytes(tokens, vocab_size))


CPU_PASS_TOKENS = 16_384
"""The pass cap on CPU, where `MemAvailable` is shared with every other process and so is
no measure of what a pass may take: 1.6 GiB of headroom on the tiny model, and a request
of 8 x 2048 tokens still one piece."""
PASS_SHARE = 0.5
"""On an accelerator, the share of the memory free after the base is loaded that a pass
may take; the rest holds the adapters' state (16 bytes a parameter each), sampling's KV
caches and the allocator's slack."""


def fit_pass_tokens(config: Any, dtype: torch.dtype, vocab_size: int, budget: int,
                    checkpointing: bool = False) -> int:
    """The most tokens a pass may have for `pass_headroom_bytes` to stay within `budget`
    (0 when not even one token fits)."""
    def fits(tokens: int) -> bool:
        return pass_headroom_bytes(config, dtype, vocab_size, tokens, checkpointing) <= budget

    low, high = 0, 1
    while fits(high) and high < 2**26:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _pass_budget(free: int, gathered: int) -> int:
    """Bytes a pass's activations may take on an accelerator: `PASS_SHARE` of the `free`
    bytes, less the weights a pass gathers on several ranks."""
    return int(free * PASS_SHARE) - gathered


def auto_checkpointing(config: Any, dtype: torch.dtype, vocab_size: int, device_type: str,
                       free: int | None, max_seq_len: int, gathered: int = 0) -> bool:
    """`--activation-checkpointing auto`: on an accelerator, on exactly when an
    uncheckpointed pass fitting `PASS_SHARE` of the `free` bytes (less `gathered`, as
    `auto_pass_tokens`) could not hold one datum of `max_seq_len`, where the server could
    not start without it: by the counts above, at the default 4,096, Qwen3-8B and larger
    on one 141 GB device, 4B and larger on 80 GB. Otherwise a larger pass runs in pieces,
    which bound memory too and cost less time than checkpointing (BENCHMARKS.md, "Passes
    in pieces"). Off on CPU, whose pass cap is fixed (`CPU_PASS_TOKENS`)."""
    if device_type == "cpu" or free is None:
        return False
    budget = _pass_budget(free, gathered)
    return fit_pass_tokens(config, dtype, vocab_size, budget) < max_seq_len


def auto_pass_tokens(config: Any, dtype: torch.dtype, vocab_size: int, device_type: str,
                     free: int | None, max_seq_len: int, checkpointing: bool = False,
                     gathered: int = 0) -> int:
    """`--max-pass-tokens 0`: `CPU_PASS_TOKENS` on CPU (at least `max_seq_len`); on an
    accelerator the largest pass whose headroom, plus the weights a pass gathers on
    several ranks (`gathered`), fits in `PASS_SHARE` of the `free` bytes. Raises
    InvalidArgument, with the numbers, when one datum of `max_seq_len` would not fit."""
    if device_type == "cpu" or free is None:
        return max(CPU_PASS_TOKENS, max_seq_len)
    budget = _pass_budget(free, gathered)
    tokens = fit_pass_tokens(config, dtype, vocab_size, budget, checkpointing)
    if tokens < max_seq_len:
        need = pass_headroom_bytes(config, dtype, vocab_size, max_seq_len, checkpointing)
        raise InvalidArgument(
            f"memory: a pass must hold one datum of --max-seq-len {max_seq_len} tokens, "
            f"whose activations need {need / 2**30:.1f} GiB, but {PASS_SHARE:.0%} of the "
            f"{free / 2**30:.1f} GiB free after loading the base is "
            f"{max(budget, 0) / 2**30:.1f} GiB; "
            f"{'' if checkpointing else 'turn on --activation-checkpointing, '}lower "
            "--max-seq-len, or shard the base over more devices")
    return tokens


def auto_max_seq_len(config: Any, dtype: torch.dtype, vocab_size: int, device_type: str,
                     free: int | None, limit: int, checkpointing: bool,
                     gathered: int = 0) -> int:
    """`--max-seq-len 0`: the longest datum a training pass can hold, at most `limit` (the
    model's `max_position_embeddings`, `--max-batch-tokens`, a given `--max-pass-tokens`).
    On CPU at most `CPU_PASS_TOKENS`, the CPU's pass cap (its `MemAvailable` is no measure,
    as in `auto_pass_tokens`); on an accelerator the most tokens whose pass headroom, plus
    `gathered`, fits in `PASS_SHARE` of the `free` bytes, counted with activation
    checkpointing when it may be on (`checkpointing`: `on` or `auto`, which then turns it on
    exactly when this length needs it). Raises InvalidArgument when not one token fits."""
    if device_type == "cpu" or free is None:
        return min(limit, CPU_PASS_TOKENS)
    budget = _pass_budget(free, gathered)
    tokens = min(limit, fit_pass_tokens(config, dtype, vocab_size, budget, checkpointing))
    if tokens < 1:
        raise InvalidArgument(
            f"memory: {PASS_SHARE:.0%} of the {(free or 0) / 2**30:.1f} GiB free after "
            "loading the base holds no training pass at all; shard the base over more "
            "devices or use a larger device")
    return tokens


OUT_OF_MEMORY = (MemoryError, torch.OutOfMemoryError)
"""What running out of host or device memory raises (torch's CUDA error is a RuntimeError)."""


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory for new adapter state on `device` (None when it cannot be read).

    On CUDA, what the driver reports free plus what torch's caching allocator holds
    unused: after a large pass the allocator keeps its blocks, which the driver counts
    as used, though any new tensor of this process can have them."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + cached
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


KV_SHARE = 0.25
"""Of the memory free once the base and the pass headroom are in place, what the decode
pool's KV cache may take by default (`--kv-pool-tokens 0`)."""
KV_POOL_MAX = 1 << 20
"""The default pool's cap in positions: beyond it a CPU's decode steps are too slow to
use more rows, and an accelerator should size it with the flag."""
KV_POOL_UNKNOWN = 65_536
"""The default pool where free memory cannot be read."""


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Keys and values of one position over every attention layer, in bytes (a hybrid's
    recurrent layers hold a state per row instead: `state_bytes_per_row`)."""
    return layer_kinds.kv_elements_per_token(config) * torch.finfo(dtype).bits // 8


def state_bytes_per_row(config: Any) -> int:
    """What a decoding row's recurrent mixers hold whatever its length, in bytes: counted
    as float32 (the scans keep their states in float32 on any base dtype; the convs'
    inputs are the base's dtype, so this bounds them)."""
    return layer_kinds.state_elements_per_row(config) * 4


def auto_kv_pool_tokens(config: Any, dtype: torch.dtype, free: int | None) -> int:
    """`--kv-pool-tokens 0`: `KV_SHARE` of the `free` bytes in KV positions, at most
    `KV_POOL_MAX` (`KV_POOL_UNKNOWN` when free memory is unknown)."""
    if free is None:
        return KV_POOL_UNKNOWN
    per_position = max(1, kv_bytes_per_token(config, dtype))
    return max(1, min(KV_POOL_MAX, int(free * KV_SHARE) // per_position))


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters and buffers held on this rank (a sharded
    parameter's local shard only)."""
    tensors = [*module.parameters(), *module.buffers()]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def checkpoint_weight_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """What a model directory's weights take once loaded in `dtype`, counted from its
    safetensors headers (nothing is read beyond them): the start-time check that every
    model fits where it is placed (`twinkle_server.config.placement`). Floating-point tensors
    take `dtype`'s size, others their own."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            size = _SAFETENSORS_BYTES.get(entry["dtype"], 4)
            if entry["dtype"].startswith(("F", "BF")):
                size = torch.finfo(dtype).bits // 8
            total += math.prod(entry["shape"]) * size
    return total


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                      "I8": 1, "U8": 1, "BOOL": 1}
