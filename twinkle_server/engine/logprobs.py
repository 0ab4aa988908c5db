"""Target log-probabilities from the last hidden states, a chunk of tokens at a time.

For every position with hidden state `h: [H]` and target `t`, the output layer (with the
LoRA delta of the position's adapter, when an adapter targets it) and the model's final
logit transform `f` (a soft-cap or scale, identity for most models) give

    z = f(W_out h + s_a B_a A_a h)                   [V] logits, float32
    logp(t) = z_t - logsumexp(z)

A whole pass's logits would be `[tokens x V]` float32: 4 x 1024 tokens of a 151,936-token
vocabulary are 2.3 GiB, and as much again for their gradient. Here at most
`chunk_tokens(V)` positions' logits exist at once: a training pass keeps only each chunk's
hidden states and targets, and recomputes the chunk's logits in backward
(`torch.utils.checkpoint`), so peak memory grows with the chunk, not the pass.

Positions are flat: `hidden` is `[N, H]` (every real position of the pass, rows one after
another) and `segments` says which adapter owns which positions, in the `lora.Segment`
layout, in token units. Each chunk runs the output layer under its own slice of the
segments, so a position gets its own adapter's delta, as in `MultiLoraLinear`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from twinkle_server.engine.base_model import final_logit_transform
from twinkle_server.engine.lora import TOKENS, Router, Segment

LOGITS_CHUNK_BYTES = 128 * 2**20
"""Float32 logits of one chunk, in bytes: 128 MiB is 220 positions of a 151,936-token
vocabulary (Qwen3), or 8,192 of the tiny model's 4,096. A chunk's backward holds about
four such tensors at once (logits, log-softmax, and the two gradients), ~0.5 GiB, and
220 x H x 151,936 is still a large enough matmul to keep a CPU or GPU busy."""

_FLOAT32_BYTES = 4


def chunk_tokens(vocab_size: int) -> int:
    """Positions per chunk: as many as keep `[chunk, vocab]` float32 within
    `LOGITS_CHUNK_BYTES` (read at call time, so a test can shrink it), at least 1."""
    return max(1, LOGITS_CHUNK_BYTES // (vocab_size * _FLOAT32_BYTES))


@contextlib.contextmanager
def pinned(router: Router, segments: tuple[Segment, ...], axis: int) -> Iterator[None]:
    """Within this block, the router's segments and axis are exactly these (already built:
    a chunk's slice, or the routing a forward ran under, put back for its replay in
    backward, after the pass's own `Router.route` block has closed)."""
    previous = router.segments, router.axis
    router.segments, router.axis = segments, axis
    try:
        yield
    finally:
        router.segments, router.axis = previous


def token_segments(spans: Sequence[tuple[str | None, bool, int]]) -> tuple[Segment, ...]:
    """Segments over flat positions from `(adapter_id, train, positions)` per row, rows in
    order; neighbouring rows of the same adapter and train flag join one segment."""
    segments: list[Segment] = []
    start = 0
    for adapter_id, train, n in spans:
        last = segments[-1] if segments else None
        if last is not None and (last.adapter_id, last.train) == (adapter_id, train):
            segments[-1] = Segment(adapter_id, last.start, start + n, train)
        else:
            segments.append(Segment(adapter_id, start, start + n, train))
        start += n
    return tuple(segments)


def _slice(segments: tuple[Segment, ...], start: int, end: int) -> tuple[Segment, ...]:
    """The segments of positions `[start, end)`, shifted to start at 0."""
    return tuple(Segment(s.adapter_id, max(s.start, start) - start, min(s.end, end) - start,
                         s.train)
                 for s in segments if s.start < end and s.end > start)


@dataclass(frozen=True)
class OutputHead:
    """The output layer and what the model does to its output before returning logits.

    `layer` is `get_output_embeddings()` (a `MultiLoraLinear` once the engine has wrapped
    it, reading `router`); `transform` is the model's final logit soft-cap or scale
    (`base_model.final_logit_transform`), None for none.
    """

    layer: nn.Module
    router: Router | None
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def of(cls, model: nn.Module, router: Router | None = None) -> OutputHead:
        """The head of a causal LM; `router` None when the caller routes (`row_logits`)."""
        return cls(model.get_output_embeddings(), router, final_logit_transform(model.config))

    def logits(self, hidden: torch.Tensor, segments: tuple[Segment, ...]) -> torch.Tensor:
        """Float32 logits `[n, V]` of `hidden: [n, H]`, position i under its segment's
        adapter (`segments` cover `[0, n)`)."""
        if self.router is None:
            raise ValueError("OutputHead.logits needs a router; this head has none")
        with pinned(self.router, segments, TOKENS):
            logits = self.layer(hidden)
        return self._finish(logits)

    def row_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[n, V]` of `hidden: [n, H]`, positions of the ONE row the
        caller's `Router.route` block has routed (prompt logprobs)."""
        return self._finish(self.layer(hidden[None])[0])

    def _finish(self, logits: torch.Tensor) -> torch.Tensor:
        if self.transform is not None:
            logits = self.transform(logits)
        return logits.float()


def target_logprobs(head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor,
                    segments: tuple[Segment, ...], hits: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) of every position, chunk by chunk; and, with `hits`, whether the
    target is the argmax of the logits (1.0 or 0.0; an argmax, so a tie at the top counts
    only for the first of the tied tokens).

    Args:
        head: the output layer, router and logit transform.
        hidden: `[N, H]` last hidden states (model dtype).
        targets: `[N]` or `[N, K]` token ids; the logprobs take the same shape. `hits`
            needs `[N]`.
        segments: adapter of each position (token units, covering `[0, N)`).

    With grad enabled, each chunk is recomputed in backward (its logits are never kept);
    with grad disabled (evaluation, sampling) nothing is kept anyway. A pass whose logits
    fit in one chunk runs as one plain chunk: recomputing it would save nothing.
    """
    targets = targets.long()
    if hits and targets.ndim != 1:
        raise ValueError(f"hits needs [N] targets, got shape {list(targets.shape)}")
    n = hidden.shape[0]
    if n == 0:
        empty = hidden.new_zeros(targets.shape, dtype=torch.float32)
        return empty, (empty if hits else None)
    size = chunk_tokens(_vocab_size(head.layer))
    recompute = torch.is_grad_enabled() and n > size
    lps, tops = [], []
    for start in range(0, n, size):
        end = min(start + size, n)
        args = (head, _slice(segments, start, end), hits)
        if recompute:
            lp, top = checkpoint(_chunk, hidden[start:end], targets[start:end], *args,
                                 use_reentrant=False)
        else:
            lp, top = _chunk(hidden[start:end], targets[start:end], *args)
        lps.append(lp)
        tops.append(top)
    lp = lps[0] if len(lps) == 1 else torch.cat(lps)
    return lp, (torch.cat(tops) if hits else None)


def _chunk(hidden: torch.Tensor, targets: torch.Tensor, head: OutputHead,
           segments: tuple[Segment, ...], hits: bool
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = head.logits(hidden, segments)
    if targets.ndim == 1:
        lp = -F.cross_entropy(logits, targets, reduction="none")
    else:
        lp = torch.log_softmax(logits, dim=-1).gather(-1, targets)
    top = None
    if hits:
        # After the loss: a recomputation stops once the tensors saved for backward
        # exist again, so the argmax is not paid twice.
        with torch.no_grad():
            top = (logits.argmax(-1) == targets).float()
    return lp, top


def top_logprobs(head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Without grad, chunk by chunk over the positions `hidden: [N, H]` of one row routed
    by the caller: log p(target) `[N]` and, for `k` > 0, the `k` largest logprobs
    `[N, min(k, V)]` with their token ids (prompt logprobs)."""
    size = chunk_tokens(_vocab_size(head.layer))
    own, values, indices = [], [], []
    with torch.no_grad():
        # At least one (maybe empty) chunk, so an empty row gives empty `[0, k]` results.
        for start in range(0, max(hidden.shape[0], 1), size):
            end = min(start + size, hidden.shape[0])
            logp = torch.log_softmax(head.row_logits(hidden[start:end]), dim=-1)
            own.append(logp.gather(-1, targets[start:end, None].long()).squeeze(-1))
            if k > 0:
                top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
                values.append(top.values)
                indices.append(top.indices)
    if k == 0:
        return torch.cat(own), None, None
    return torch.cat(own), torch.cat(values), torch.cat(indices)


def _vocab_size(layer: nn.Module) -> int:
    out = getattr(layer, "out_features", None)
    return int(out if out is not None else layer.weight.shape[0])
