"""Prompt scoring: what one teacher-forced pass over a prompt can return besides samples.

For a prompt `t_0 .. t_{T-1}`, position `p >= 1` has the next-token distribution

    logp_p = log_softmax(z_p),   z_p = the logits after t_0 .. t_{p-1}     [V]

(untempered, as the sampled tokens' logprobs), and a request may ask, in one pass:

- own logprobs: `logp_p[t_p]` for every `p` (NaN at 0), or only for the last `last_n`
  positions (NaN before them: Tinker's `prompt_logprobs_last_n`);
- top-k: the `k` largest `logp_p` with their ids, most likely first, over the same
  positions as the own logprobs (other rows: token 0 / `TOPK_MASK_LOGPROB`);
- targets: `logp_p[ids[p - 1, j]]` for an int64 `[T - 1, K]` id table, `-1` = nothing
  asked (0.0 returned there: Tinker's `target_prompt_logprobs`);
- alternatives: `k` draws with replacement from `softmax(z_p / temperature)` (the argmax
  `k` times at temperature 0), each with its untempered `logp_p` (Tinker's
  `prompt_alt_tokens_k`). Only the temperature shapes the draws, as Tinker documents
  them: `top_k` and `top_p` apply to the sampled completion, not to these.

Logits exist only for the rows something asks about (a request for one target at the
last position computes one row of logits, not `T`), a chunk of rows at a time
(`logprobs.chunk_tokens`), as in `logprobs.top_logprobs`.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from twinkle_server.engine.base_model import last_hidden_states
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.logprobs import OutputHead, _vocab_size, chunk_tokens
from twinkle_server.engine.temperature import tempered

MAX_TOPK = 20
"""Most top-k alternatives one request may ask for, per prompt or sampled position
(Tinker's own cap); `prompt_alt_tokens_k` shares it: k draws cost what a top-k of k does."""
MAX_TARGET_IDS = 64
"""Most distinct token ids one `target_prompt_logprobs` table may name. The cost is a
`[rows, distinct ids]` gather, like a top-k of that width; 64 covers a decision over every
letter and digit."""
TOPK_MASK_LOGPROB = -99999.0
"""Logprob of the filler in rows with nothing scored (position 0, rows before
`last_n`): Tinker's sentinel."""

Route = Callable[[Sequence[str | None]], AbstractContextManager]


@dataclass(frozen=True)
class PromptScoring:
    """What to compute over a prompt (see the module docstring).

    `include`: own logprobs are wanted (they are always computed for the scored rows,
    a gather, and returned NaN elsewhere). `last_n`: None scores every position.
    `targets`: int64 `[T - 1, K]`, -1 = none. `alt_k`: draws per position, at
    `temperature`, from a generator seeded with `seed` (None: a random seed).
    """

    include: bool = False
    topk: int = 0
    last_n: int | None = None
    targets: np.ndarray | None = None
    alt_k: int = 0
    temperature: float = 1.0
    seed: int | None = None

    @property
    def wanted(self) -> bool:
        """Whether there is anything to compute at all."""
        return bool(self.include or self.topk or self.targets is not None or self.alt_k)


@dataclass(frozen=True)
class PromptLogprobs:
    """The scores of one prompt of `T` tokens.

    `logprobs` float32 `[T]`: `logp_p[t_p]`, NaN at 0 and before `last_n`.
    `topk_token_ids` int32 / `topk_logprobs` float32 `[T, k]` (k > 0): the k likeliest
    tokens at each scored position, most likely first; other rows token 0 /
    `TOPK_MASK_LOGPROB`. `target_logprobs` float32 `[T - 1, K]`: row i at position i + 1,
    0.0 where the id was -1. `alt_tokens` int64 / `alt_logprobs` float32 `[T - 1, k]`.
    """

    logprobs: np.ndarray
    topk_token_ids: np.ndarray | None
    topk_logprobs: np.ndarray | None
    target_logprobs: np.ndarray | None = None
    alt_tokens: np.ndarray | None = None
    alt_logprobs: np.ndarray | None = None


def check_topk(topk: int, field: str = "topk_prompt_logprobs") -> None:
    """Raise `InvalidArgument` unless 0 <= topk <= MAX_TOPK."""
    if not 0 <= topk <= MAX_TOPK:
        raise InvalidArgument(f"{field}: must be in [0, {MAX_TOPK}], got {topk}")


def check(scoring: PromptScoring, prompt_len: int, vocab_size: int | None = None) -> None:
    """Raise `InvalidArgument` naming the field and its limit; nothing is computed first.

    Args:
        scoring: the request's options.
        prompt_len: T, the prompt's length in tokens.
        vocab_size: when given, target ids must be below it.
    """
    check_topk(scoring.topk)
    check_topk(scoring.alt_k, "prompt_alt_tokens_k")
    if scoring.last_n is not None:
        if not (scoring.include or scoring.topk):
            raise InvalidArgument("prompt_logprobs_last_n: applies to prompt logprobs; set "
                                  "prompt_logprobs (include_prompt_logprobs) too")
        if not 1 <= scoring.last_n <= prompt_len - 1:
            raise InvalidArgument(f"prompt_logprobs_last_n: must be between 1 and "
                                  f"len(prompt) - 1 = {prompt_len - 1}, got {scoring.last_n}")
    if scoring.alt_k and not (math.isfinite(scoring.temperature) and scoring.temperature >= 0):
        raise InvalidArgument(f"sampling_params.temperature: must be finite and >= 0 for "
                              f"prompt_alt_tokens_k, got {scoring.temperature}")
    ids = scoring.targets
    if ids is None:
        return
    if ids.ndim != 2 or ids.shape[0] != prompt_len - 1:
        raise InvalidArgument(f"target_prompt_logprobs: must have shape [len(prompt) - 1, K] "
                              f"= [{prompt_len - 1}, K], got {list(ids.shape)}")
    named = ids[ids != -1]
    if named.size == 0:
        raise InvalidArgument("target_prompt_logprobs: names no token id (every cell is -1); "
                              "give at least one")
    high = vocab_size if vocab_size is not None else np.iinfo(np.int64).max
    bad = named[(named < 0) | (named >= high)]
    if bad.size:
        raise InvalidArgument(f"target_prompt_logprobs: token id {int(bad[0])} is outside "
                              f"[0, {high}) (-1 = no id)")
    distinct = np.unique(named).size
    if distinct > MAX_TARGET_IDS:
        raise InvalidArgument(f"target_prompt_logprobs: {distinct} distinct token ids; at "
                              f"most {MAX_TARGET_IDS} per request")


def _first_row(scoring: PromptScoring, rows: int) -> int:
    """The first hidden row (row r predicts prompt position r + 1) anything asks about."""
    first = rows
    if scoring.include or scoring.topk:
        first = rows - scoring.last_n if scoring.last_n is not None else 0
    if scoring.alt_k:
        first = 0
    if scoring.targets is not None:
        asked = np.flatnonzero((scoring.targets >= 0).any(axis=1))
        if asked.size:
            first = min(first, int(asked[0]))
    return first


@torch.inference_mode()
def score_prompt(model: torch.nn.Module, route: Route, adapter_id: str | None,
                 tokens: np.ndarray, scoring: PromptScoring) -> PromptLogprobs:
    """Everything `scoring` asks about `tokens` (int64 `[T]`) under `adapter_id` (None =
    the bare base), in one teacher-forced pass; see `PromptLogprobs`.

    Raises:
        InvalidArgument: an option out of range (`check`), before any compute.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    check(scoring, tokens.size)
    device = next(model.parameters()).device
    rows = tokens.size - 1
    first = _first_row(scoring, rows)
    ids = torch.from_numpy(tokens)[None].to(device)
    own = np.full(tokens.size, np.nan, np.float32)
    k = scoring.topk
    top_ids = np.zeros((tokens.size, k), np.int32) if k else None
    top_lps = np.full((tokens.size, k), TOPK_MASK_LOGPROB, np.float32) if k else None
    own_first = rows if not (scoring.include or k) else (
        rows - scoring.last_n if scoring.last_n is not None else 0)
    targets = (torch.from_numpy(np.ascontiguousarray(scoring.targets, np.int64)).to(device)
               if scoring.targets is not None else None)
    target_lps = (np.zeros(scoring.targets.shape, np.float32)
                  if scoring.targets is not None else None)
    alt_tokens = np.zeros((max(rows, 0), scoring.alt_k), np.int64) if scoring.alt_k else None
    alt_lps = np.zeros((max(rows, 0), scoring.alt_k), np.float32) if scoring.alt_k else None
    generator = None
    if scoring.alt_k and scoring.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(
            scoring.seed if scoring.seed is not None else secrets.randbits(63))
    if first >= rows:
        return PromptLogprobs(own, top_ids, top_lps, target_lps, alt_tokens, alt_lps)
    with route([adapter_id]):
        hidden = last_hidden_states(model, input_ids=ids, use_cache=False)[0, first:rows]
        head = OutputHead.of(model)
        size = chunk_tokens(_vocab_size(head.layer))
        for start in range(first, rows, size):
            end = min(start + size, rows)
            logp = torch.log_softmax(head.row_logits(hidden[start - first:end - first]), -1)
            _score_chunk(logp, start, end, ids[0], scoring, own_first, generator, own,
                         top_ids, top_lps, targets, target_lps, alt_tokens, alt_lps)
    return PromptLogprobs(own, top_ids, top_lps, target_lps, alt_tokens, alt_lps)


def _score_chunk(logp: torch.Tensor, start: int, end: int, ids: torch.Tensor,
                 scoring: PromptScoring, own_first: int, generator: torch.Generator | None,
                 own: np.ndarray, top_ids: np.ndarray | None, top_lps: np.ndarray | None,
                 targets: torch.Tensor | None, target_lps: np.ndarray | None,
                 alt_tokens: np.ndarray | None, alt_lps: np.ndarray | None) -> None:
    """Fill rows `[start, end)` of the outputs from their `logp` `[end - start, V]`."""
    lo = max(start, own_first)
    if lo < end:
        mine = logp[lo - start:]
        own[lo + 1:end + 1] = mine.gather(-1, ids[lo + 1:end + 1, None]).squeeze(-1).cpu()
        if top_ids is not None and top_lps is not None:
            top = torch.topk(mine, min(scoring.topk, mine.shape[-1]), dim=-1)
            width = top.indices.shape[-1]
            top_ids[lo + 1:end + 1, :width] = top.indices.cpu().numpy()
            top_lps[lo + 1:end + 1, :width] = top.values.cpu().numpy()
    if targets is not None and target_lps is not None:
        asked = targets[start:end]
        got = logp.gather(-1, asked.clamp(min=0)).masked_fill(asked < 0, 0.0)
        target_lps[start:end] = got.cpu().numpy()
    if alt_tokens is not None and alt_lps is not None:
        if generator is None:  # temperature 0: the argmax, k times
            draws = logp.argmax(-1, keepdim=True).expand(-1, scoring.alt_k)
        else:
            # softmax(logp / T) = softmax(z / T): log_softmax shifts each row by a constant.
            probs = torch.softmax(tempered(logp, scoring.temperature), dim=-1)
            draws = torch.multinomial(probs, scoring.alt_k, replacement=True,
                                      generator=generator)
        alt_tokens[start:end] = draws.cpu().numpy()
        alt_lps[start:end] = logp.gather(-1, draws).cpu().numpy()
