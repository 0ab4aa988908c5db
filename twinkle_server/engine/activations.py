"""Activation checkpointing: decoder layers recomputed in backward instead of kept.

A training pass keeps, for backward, what every decoder layer computed on the way: for
Qwen3-style layers about 10-20 tensors of `[tokens, hidden]` or `[tokens, intermediate]`
per layer. With `--activation-checkpointing on` each decoder layer keeps only its input,
and its forward runs a second time in backward, one layer at a time: activation memory
drops from `layers x per-layer` to `layers x [tokens, hidden] + one layer`, for about one
more forward pass of compute (BENCHMARKS.md, "Training memory", has the figures).

Three things make this right on a frozen base with many LoRA adapters:

- torch's non-reentrant checkpoint (`use_reentrant=False`): gradients reach the LoRA
  weights inside a layer although the layer's input (a frozen base's embeddings) does not
  require grad, where the reentrant variant would return no gradient at all;
- the replay runs after the pass's `Router.route` block (and a packed pass's attention
  switch) has closed: each checkpointed forward records the router's segments and axis
  and the model's attention implementation, and its replay runs under them again;
- LoRA dropout replays with the same mask: the checkpoint restores the RNG state.

The base stays in eval mode: transformers checkpoints a layer only while its `training`
flag is set, so that flag is set on the decoder layers themselves and on nothing under
them (no dropout of the base turns on). Forward-only passes and sampling run without grad
and are never checkpointed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.logprobs import pinned
from twinkle_server.engine.lora import Router

log = logging.getLogger(__name__)


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def supported(model: torch.nn.Module) -> bool:
    """Whether transformers can checkpoint `model`'s decoder layers."""
    return bool(_layers(model)) and getattr(model, "supports_gradient_checkpointing", False)


def auto(model: torch.nn.Module, wanted: bool) -> bool:
    """`--activation-checkpointing auto` once the memory says `wanted`: off, with a
    warning, for a model transformers cannot checkpoint (it starts as with `off`)."""
    if wanted and not supported(model):
        log.warning("--activation-checkpointing auto: %s does not support it, so it stays "
                    "off", type(model).__name__)
        wanted = False
    log.info("activation checkpointing %s (--activation-checkpointing auto)",
             "on" if wanted else "off")
    return wanted


def enable(model: torch.nn.Module, router: Router, keep_input_grads: bool = False) -> int:
    """Checkpoint every decoder layer of `model` (a transformers `PreTrainedModel`) whose
    forward reads `router`; returns how many layers. `keep_input_grads` leaves the input
    embeddings' output requiring grad (several ranks need it: `Parallel.shard`). Raises
    InvalidArgument for a model transformers cannot checkpoint."""
    layers = _layers(model)
    if not supported(model):
        config = getattr(model, "config", None)
        arch = (getattr(config, "architectures", None) or [type(model).__name__])[0]
        raise InvalidArgument(f"--activation-checkpointing: {arch} does not support "
                              "transformers' activation checkpointing; run with it off")

    def replay_context() -> tuple[contextlib.AbstractContextManager, contextlib.
                                  AbstractContextManager]:
        # Called by each checkpointed forward: nothing to do now; its replay runs under
        # the routing and attention implementation in force at this moment.
        return contextlib.nullcontext(), _replaying(model, router, router.segments,
                                                    router.axis,
                                                    model.config._attn_implementation)

    kwargs = {"use_reentrant": False, "context_fn": replay_context}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers also hooks the input embeddings to require grad (for the reentrant
    # variant); non-reentrant needs no such thing, and it would add a backward through
    # every layer's input to the embeddings, which nothing trains.
    if not keep_input_grads:
        model.disable_input_require_grads()
    for layer in layers:
        layer.training = True  # this module only: model.train() would turn on base dropout
    return len(layers)


@contextlib.contextmanager
def _replaying(model: torch.nn.Module, router: Router, segments, axis: int,
               attn_implementation: str) -> Iterator[None]:
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = attn_implementation
    try:
        with pinned(router, segments, axis):
            yield
    finally:
        config._attn_implementation = previous
