"""A reference sample and what it drew from, for comparing the same seeded request run
another way (in company, in the pool, with a cached prefix, on another rank).

Two such runs draw the same uniform numbers on logits a rounding apart, so their tokens
agree up to a draw that lands within rounding of a boundary between two tokens, and no
further: `tests/numerics.py` (NEAR_TIE) says how near, and why. To tell such a near tie
from a real difference, the reference run is recorded at the engine's one token step
(`engine/sampling/tokens.py`, shared by the pool and the static batch): each step's
logits and the uniform numbers its draw took from the request's generator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from twinkle_server.engine.sampling import tokens as token_step
from twinkle_server.engine.types import SampledSequence, SamplingParams

from ..numerics import assert_rows_alike, drawable


@dataclass
class _Call:
    logprobs: np.ndarray            # [n, V] float64, untempered
    segments: list[tuple[list[int], int]]   # rows, id of the generator
    uniforms: dict[int, np.ndarray]        # id of a generator -> the numbers it gave


@contextlib.contextmanager
def _recording() -> Iterator[list[_Call]]:
    """Inside the block, every draw's logits and uniform numbers are kept (the draw itself
    is unchanged)."""
    real_draw, real_uniforms = token_step.draw, token_step.uniforms
    calls: list[_Call] = []

    def uniforms(rows, generator, like):
        numbers = real_uniforms(rows, generator, like)
        calls[-1].uniforms[id(generator)] = numbers[:, 0].double().cpu().numpy()
        return numbers

    def draw(logits, segments, topk):
        calls.append(_Call(torch.log_softmax(logits.double(), -1).cpu().numpy(),
                           [(list(s.rows), id(s.generator)) for s in segments], {}))
        return real_draw(logits, segments, topk)

    token_step.draw, token_step.uniforms = draw, uniforms
    try:
        yield calls
    finally:
        token_step.draw, token_step.uniforms = real_draw, real_uniforms


@dataclass
class Reference:
    """One request's sequences sampled alone, and per row and step what its draw saw:
    the untempered logprobs over the vocabulary and the uniform number (None: greedy)."""

    sequences: list[SampledSequence]
    params: SamplingParams
    steps: list[list[tuple[np.ndarray, float | None]]]

    def could_draw(self, row: int) -> Callable[[int, int], bool]:
        p = self.params

        def could(step: int, token: int) -> bool:
            logprobs, uniform = self.steps[row][step]
            return bool(drawable(logprobs, uniform, temperature=p.temperature,
                                 top_k=p.top_k, top_p=p.top_p)[token])
        return could


def sampled_alone(sample: Callable[[], Sequence[SampledSequence]],
                  params: SamplingParams) -> Reference:
    """Run `sample()`, one request alone (its rows the only rows of every draw), and keep
    what each of its draws saw."""
    with _recording() as calls:
        sequences = list(sample())
    lengths = [len(s.tokens) for s in sequences]
    steps: list[list[tuple[np.ndarray, float | None]]] = [[] for _ in sequences]
    for step, call in enumerate(calls):
        active = [row for row, n in enumerate(lengths) if n > step]
        [(rows, generator)] = call.segments
        assert rows == list(range(len(active))), "the reference is not one request alone"
        numbers = call.uniforms.get(generator)
        for i, row in enumerate(active):
            steps[row].append((call.logprobs[i], None if numbers is None else numbers[i]))
    assert [len(s) for s in steps] == lengths, "a draw was not recorded"
    reference = Reference(sequences, params, steps)
    for row, sequence in enumerate(sequences):   # the record reproduces its own draws
        could = reference.could_draw(row)
        assert all(could(step, int(t)) for step, t in enumerate(sequence.tokens)), \
            "the reference's own tokens are not what its record draws"
    return reference


def assert_sampled_alike(reference: Reference, got: Sequence[SampledSequence],
                         what: str = "") -> list[int]:
    """`got`, the reference's request run another way, agrees with it row by row up to
    the first near tie that went the other way (`numerics.assert_rows_alike`). Returns
    how many tokens of each row agree."""
    p = reference.params
    return assert_rows_alike(reference.sequences, got, reference.could_draw, what,
                             draws_numbers=not (p.temperature == 0 or p.top_k == 1))
