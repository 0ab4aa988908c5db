"""How long a sequence the engine serves: `--max-seq-len` checked against the model's
context, or chosen (0) from the context, the pass limits and memory; and the rotary
embeddings whose numbers for one sequence depend on the longest in its forward call,
which hold every sequence to the length where they do not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from twinkle_server.engine import memory
from twinkle_server.engine.base_model import BaseModel
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import AUTO_SEQ_LEN, EngineLimits

log = logging.getLogger(__name__)


def resolve_seq_len(base: BaseModel, limits: EngineLimits,
                    free_bytes: Callable[[], int | None], checkpointing: bool | None,
                    gathered: int) -> EngineLimits:
    """`limits` with `max_seq_len` chosen when `AUTO_SEQ_LEN` (the model's context, at
    most `max_batch_tokens`, a given `max_pass_tokens` and what memory allows:
    `memory.auto_max_seq_len`, read from `free_bytes` only then: on several ranks it
    is a collective), and logged. A value given above the model's
    `max_position_embeddings` is refused: positions past it were never trained.

    A `longrope` model (Phi-3.5, Phi-4-mini) is held to its
    `original_max_position_embeddings` (`longrope_limit`), where
    transformers always runs the short factors: past it a forward call switches to
    the long ones for all of its sequences, so one datum would change the numbers of
    every other in its pass (other tenants' included), and the sampler's prefills and
    steps, whose calls hold other rows, would disagree with the trainer's. Dynamic
    NTK rope rescales likewise past `max_position_embeddings`, which the context
    bound already keeps every sequence within."""
    context = getattr(base.text_config, "max_position_embeddings", None)
    rope = longrope_limit(base.config)
    if limits.max_seq_len != AUTO_SEQ_LEN:
        if context and limits.max_seq_len > context:
            raise InvalidArgument(
                f"max_seq_len: --max-seq-len {limits.max_seq_len} is over the model's "
                f"max_position_embeddings {context}; give at most {context}, or 0 for "
                "the model's own bounded by memory")
        if rope and limits.max_seq_len > rope:
            raise InvalidArgument(
                f"max_seq_len: --max-seq-len {limits.max_seq_len} is over {rope}, the "
                "original_max_position_embeddings of the model's longrope rotary "
                "embedding: longrope switches to its long factors for a whole forward "
                f"pass once one sequence in it is longer than {rope} tokens, so a longer "
                "sequence would change other tenants' numbers and the sampler's; give "
                f"at most {rope}, or 0")
        log.info("sequences of at most %d tokens (--max-seq-len)", limits.max_seq_len)
        return limits
    bound = min(n for n in (base.max_seq_len, limits.max_batch_tokens,
                            limits.max_pass_tokens, rope or 0) if n > 0)
    if rope and rope < base.max_seq_len:
        log.info("longrope model: sequences are held to its %d-token "
                 "original_max_position_embeddings, past which its rotary embedding "
                 "switches factors for every sequence of a pass", rope)
    chosen = memory.auto_max_seq_len(
        base.config, base.dtype, base.vocab_size, base.device.type,
        free_bytes(), bound, checkpointing is not False, gathered)
    log.info("sequences of at most %d tokens (--max-seq-len 0: the model's "
             "max_position_embeddings %d, at most --max-batch-tokens %d and what memory "
             "allows on %s)", chosen, base.max_seq_len, limits.max_batch_tokens,
             base.device.type)
    return replace(limits, max_seq_len=chosen)


def longrope_limit(config: Any) -> int | None:
    """The sequence length past which the model's `longrope` rotary embedding (Phi-3.5,
    Phi-4-mini) switches from its short factors to its long ones; None without longrope.

    transformers picks the factors for a whole forward call from its longest position
    (`modeling_rope_utils.longrope_frequency_update`: long where max(position_ids) + 1 >
    original_max_position_embeddings), so past this length one sequence changes every
    other's numbers in its pass. Read from the rope parameters (`rope_parameters`, per
    layer type where nested; `rope_scaling` before transformers 5, where Phi-3 called it
    `su`): their `original_max_position_embeddings`, else the config's, else its
    `max_position_embeddings`, as transformers fills it in."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    nested = not ({"rope_type", "type"} & params.keys())
    limits = []
    for rope in (params.values() if nested else [params]):
        if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) not in (
                "longrope", "su"):
            continue
        length = (rope.get("original_max_position_embeddings")
                  or getattr(config, "original_max_position_embeddings", None)
                  or getattr(config, "max_position_embeddings", None))
        if length:
            limits.append(int(length))
    return min(limits) if limits else None
