"""What `MultiLoraTransformersModel` returns: adapter records, forward outputs, samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twinkle_client.client import _Record


class AdapterInfo(_Record):
    """One adapter of the model: its server run and what it trains."""

    adapter_name: str
    training_run_id: str
    base_model: str
    target_modules: list[str]
    trainable_params: int
    state_bytes: int
    gradient_accumulation_steps: int


@dataclass
class ForwardOutput:
    """A forward(_backward)'s result: the loss (a token mean for CrossEntropyLoss), the
    metrics ("name:reduction") and each sequence's target-token logprobs, in input order."""

    loss: float
    metrics: dict[str, float]
    logps: list[np.ndarray] = field(repr=False)

    def __repr__(self) -> str:
        return (f"ForwardOutput(loss={self.loss:.4f}, sequences={len(self.logps)}, "
                f"metrics={self.metrics})")


@dataclass
class SampledSequence:
    """One completion: its tokens, their logprobs under the adapter that sampled them,
    why it stopped ('stop' or 'length'), its text, and `new_input_feature`: prompt plus
    completion as a training feature (labels on the completion only) for RL."""

    prompt_index: int
    tokens: np.ndarray
    logprobs: np.ndarray
    stop_reason: str
    text: str
    new_input_feature: dict[str, np.ndarray] = field(repr=False)


@dataclass
class SampleOutput:
    """Every completion of a `sample` call: prompt by prompt, `num_samples` each."""

    sequences: list[SampledSequence]
