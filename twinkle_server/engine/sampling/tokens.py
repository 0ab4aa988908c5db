"""One token step, shared by the decode pool and the static batch: each row's next token
under its request's parameters, its untempered logprob and top-k, the stop rule, and the
refusal of logits that are not finite.

* Draws walk the vocabulary in token-id order. The kept set (top-k, then top-p) is chosen
  by sorting, but the draw runs over the kept tokens by id, so two logits a rounding apart
  (another batch, other padding: within 5e-7 on the tiny model) never trade places in the
  walk. A seeded request therefore picks the same tokens alone and in company, unless a
  kept set differs at its very edge or a draw lands within rounding of a boundary.
* Logprobs are of the sampled token under the untempered distribution (log-softmax of the
  raw logits), what a teacher-forced forward gives; RL losses use them as `old_logp`.
* A row whose logits are not finite (NaN, +inf, or all -inf: a diverged adapter) is not
  drawn from; it is reported, and only its request fails (`not_finite`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import PurePath

import numpy as np
import torch

from twinkle_server.engine.errors import FailedPrecondition
from twinkle_server.engine.prompt_scoring import TOPK_MASK_LOGPROB
from twinkle_server.engine.temperature import tempered
from twinkle_server.engine.types import (
    SampledSequence,
    SampleRequest,
    SamplingParams,
    StopReason,
)


def new_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """One stream per request, on the logits' device so sampling copies nothing to the host."""
    return torch.Generator(device=device).manual_seed(
        seed if seed is not None else secrets.randbits(63))


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
         ) -> torch.Tensor:
    """One token per row of finite `logits` `[n, V]` under the request's parameters."""
    if greedy(params):
        return logits.argmax(-1)
    scores = tempered(logits, params.temperature)
    top_k = _top_k(params, scores.shape[-1])
    if top_k or params.top_p < 1.0:
        # topk returns its values sorted, so top-p below sorts only k columns, not V.
        ordered, order = (torch.topk(scores, top_k, dim=-1) if top_k
                          else torch.sort(scores, dim=-1, descending=True))
        if params.top_p < 1.0:
            probs = torch.softmax(ordered, dim=-1)
            # Drop a token when the mass before it already reaches top_p; the first always
            # stays (a top_p that rounds to 0 in the logits' dtype keeps it alone).
            drop = (probs.cumsum(-1) - probs) >= params.top_p
            drop[..., 0] = False
            ordered = ordered.masked_fill(drop, float("-inf"))
        # Back to token-id order: the draw below walks the kept tokens by id.
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
    return _inverse_cdf(torch.softmax(scores, dim=-1), uniforms(scores.shape[0], generator,
                                                                scores))


def greedy(params: SamplingParams) -> bool:
    """Whether `params` take each row's most likely token (no draw)."""
    return params.temperature == 0 or params.top_k == 1


def plain(params: SamplingParams, vocab: int) -> bool:
    """Whether `params` draw from the whole tempered distribution (no top-k or top-p):
    such rows of several requests are drawn in one batch (`draw`)."""
    return not greedy(params) and params.top_p >= 1.0 and not _top_k(params, vocab)


def _top_k(params: SamplingParams, vocab: int) -> int:
    """The top-k `params` keep over a `vocab`-token vocabulary; 0 when they keep all."""
    return params.top_k if 0 < params.top_k < vocab else 0


def uniforms(rows: int, generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """`[rows, 1]` uniform numbers from a request's `generator`: its draw's only use of it."""
    return torch.rand((rows, 1), generator=generator, device=like.device, dtype=like.dtype)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` `[n, V]`: the first token, in id order, whose
    cumulative probability passes the row's uniform number `u` `[n, 1]`.

    `torch.multinomial` draws an exponential number for every token of every row (on a
    CPU, a sixth of a decode step's time for 96 rows of a 4,096-token vocabulary); this
    draws one. A token of probability 0 is never picked: its cumulative sum equals its
    predecessor's, and the draw stops below the last sum."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


@dataclass(frozen=True)
class Segment:
    """Rows `rows` of a draw belong to one request, drawn by one `pick` in that order
    (its samples' order: the decode pool may hold them anywhere in its batch)."""

    rows: Sequence[int]
    params: SamplingParams
    generator: torch.Generator

    def at(self, device: torch.device) -> slice | torch.Tensor:
        """The rows as an index: a slice when they are consecutive and ascending."""
        rows = self.rows
        if all(b == a + 1 for a, b in pairwise(rows)):
            return slice(rows[0], rows[-1] + 1)
        return torch.tensor(list(rows), dtype=torch.long, device=device)


@dataclass
class Drawn:
    """One step's draw: per row its token, its logprob (NaN where the row's logits were
    not finite: nothing was drawn there) and, when asked, its top-k."""

    chosen: torch.Tensor          # [n] on the logits' device: the next step's input
    tokens: list[int]
    logprobs: list[float]
    top_ids: np.ndarray | None    # [n, widest k]
    top_logprobs: np.ndarray | None

    def finite(self, row: int) -> bool:
        return not math.isnan(self.logprobs[row])


def draw(logits: torch.Tensor, segments: Sequence[Segment], topk: int) -> Drawn:
    """Draw the next token of every row of `logits` `[n, V]` (float32), and the top
    `topk` of every row when asked.

    Each request's generator gives the same numbers as alone: one `uniforms` call per
    segment, in order. Rows of `plain` requests are drawn together, one softmax and one
    search over all of them (a row's numbers do not depend on the rows beside it); the
    others one `pick` per segment."""
    top = logits.amax(-1)
    finite = (top > float("-inf")) & (top < float("inf"))    # NaN compares False
    safe = torch.where(finite[:, None], logits, 0.0)
    chosen = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    together = []
    for segment in segments:
        if plain(segment.params, logits.shape[-1]):
            together.append(segment)
        else:
            at = segment.at(logits.device)
            chosen[at] = pick(safe[at], segment.params, segment.generator)
    if together:
        _draw_together(safe, together, chosen)
    logp = torch.log_softmax(safe, dim=-1)
    chosen_logp = logp.gather(-1, chosen[:, None]).squeeze(-1).masked_fill(~finite, math.nan)
    top_ids = top_lps = None
    if topk:
        best = torch.topk(logp, min(topk, logp.shape[-1]), dim=-1)
        top_ids, top_lps = best.indices.cpu().numpy(), best.values.cpu().numpy()
    return Drawn(chosen, chosen.tolist(), chosen_logp.tolist(), top_ids, top_lps)


def _draw_together(logits: torch.Tensor, segments: Sequence[Segment],
                   chosen: torch.Tensor) -> None:
    """Draw the rows of `segments` (all `plain`) into `chosen`, as one batch."""
    # Segments in row order covering every row (the common case: every request plain, its
    # rows together) need no gather.
    order = [row for s in segments for row in s.rows]
    rows = None if order == list(range(logits.shape[0])) else torch.tensor(
        order, dtype=torch.long, device=logits.device)
    temperature = torch.tensor([s.params.temperature for s in segments for _ in s.rows],
                               dtype=logits.dtype, device=logits.device)[:, None]
    scores = tempered(logits if rows is None else logits[rows], temperature)
    u = torch.cat([uniforms(len(s.rows), s.generator, scores) for s in segments])
    tokens = _inverse_cdf(torch.softmax(scores, dim=-1), u)
    if rows is None:
        chosen.copy_(tokens)
    else:
        chosen[rows] = tokens


def stop_tokens(params: SamplingParams, eos_token_ids: Sequence[int]) -> set[int]:
    """The token ids that end a row: its own stops, and EOS unless `ignore_eos`."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


@dataclass(frozen=True)
class Stop:
    """Why a row stopped; `text_at`: where the stop string that ended it begins in the
    row's text (`decode(tokens)`), None when no stop string did."""

    reason: StopReason
    text_at: int | None = None


def stop_reason(tokens: Sequence[int], params: SamplingParams, stops: set[int],
                decode: Callable[[Sequence[int]], str]) -> Stop | None:
    """Why a row whose tokens are `tokens` stops now, or None. A stop string is searched
    once, here, in the text a client is shown (`BaseModel.decode`); where the earliest
    one begins travels with the row, so no front searches again."""
    if tokens[-1] in stops:
        return Stop("stop")
    if params.stop_strings:
        text = decode(tokens)
        found = [at for at in (text.find(s) for s in params.stop_strings) if at >= 0]
        if found:
            return Stop("stop", min(found))
    if len(tokens) >= params.max_tokens:
        return Stop("length")
    return None


def not_finite(request: SampleRequest) -> FailedPrecondition:
    """The failure of a request whose model gives logits that are not finite."""
    if request.adapter_id is not None:
        model = f"model {request.adapter_id!r}"
    elif request.weights_path is not None:
        model = f"the sampler checkpoint {PurePath(request.weights_path).name!r}"
    else:
        model = "the base model"
    return FailedPrecondition(
        f"sampling: the logits of {model} are not finite (NaN or inf), so no token can be "
        "drawn; its weights have diverged (a learning rate too high?). Load an earlier "
        "checkpoint; nothing else was affected")


def sequence(tokens: Sequence[int], logprobs: Sequence[float],
             topk: Sequence[tuple[np.ndarray, np.ndarray]], k: int,
             stop: Stop | None) -> SampledSequence:
    """One finished row as a `SampledSequence`: int32 tokens, float32 logprobs, and its
    per-step top-k as `[n, k]` (a vocabulary narrower than k leaves token 0 and
    `TOPK_MASK_LOGPROB` in the last columns; None when not asked)."""
    ids = lps = None
    if k:
        ids = np.zeros((len(topk), k), np.int32)
        lps = np.full((len(topk), k), TOPK_MASK_LOGPROB, np.float32)
        for i, (step_ids, step_lps) in enumerate(topk):
            n = min(k, step_ids.size)
            ids[i, :n], lps[i, :n] = step_ids[:n], step_lps[:n]
    return SampledSequence(tokens=np.asarray(tokens, dtype=np.int32),
                           logprobs=np.asarray(logprobs, dtype=np.float32),
                           stop_reason=stop.reason if stop else None,  # type: ignore[arg-type]
                           stop_text_at=stop.text_at if stop else None,
                           topk_token_ids=ids, topk_logprobs=lps)
