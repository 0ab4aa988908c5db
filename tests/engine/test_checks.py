"""The engine's checks of a request's own fields: each names the field and the limit."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle_server.engine import checks
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import EngineLimits, SampleRequest, SamplingParams


def _req(prompt, n=1, topk=0, **params):
    params = {"max_tokens": 16, **params}
    return SampleRequest(None, None, np.asarray(prompt, np.int64), n, SamplingParams(**params),
                         topk)


@pytest.mark.parametrize(("request_", "message"), [
    (_req([1], 0), "num_samples: must be >= 1"),
    (_req([1], max_tokens=0), "max_tokens: must be >= 1"),
    (_req([1], temperature=-1.0), "temperature: must be finite and >= 0"),
    (_req([1], temperature=float("nan")), "temperature: must be finite and >= 0"),
    (_req([1], top_p=0.0), r"top_p: must be in \(0, 1\]"),
    (_req([1], top_k=-2), r"top_k: must be >= 0 \(or -1 = no limit\)"),
    (_req([1], topk=21), r"topk_sample_logprobs: must be in \[0, 20\]"),
])
def test_bad_sampling_requests_name_the_field(request_, message):
    with pytest.raises(InvalidArgument, match=message):
        checks.sampling(request_)


def test_an_empty_prompt_or_one_over_the_limits_is_refused_naming_the_limit():
    limits = EngineLimits(max_seq_len=8)
    with pytest.raises(InvalidArgument, match="prompt: is empty"):
        checks.prompt(np.zeros(0, np.int64), limits, 300)
    with pytest.raises(InvalidArgument, match="9 tokens is over the 8-token limit"):
        checks.prompt(np.ones(9, np.int64), limits, 300)
    with pytest.raises(InvalidArgument, match=r"must lie in \[0, 300\)"):
        checks.prompt(np.array([300]), limits, 300)


def test_an_adapters_scaling_must_fit_float32_where_its_products_scale():
    """alpha 1e300 at rank 4 once made every forward that held the adapter fail outright
    (the scale does not convert to float32), and a merged pass with it."""
    from twinkle_server.engine.types import LoraSpec

    limits = EngineLimits(max_rank=16)
    checks.lora_spec(LoraSpec(rank=4, alpha=1e38), limits)
    with pytest.raises(InvalidArgument, match="lora.alpha: 1e.300 makes the scaling 2.5e.299"):
        checks.lora_spec(LoraSpec(rank=4, alpha=1e300), limits)
    with pytest.raises(InvalidArgument, match="lora.alpha"):
        checks.lora_spec(LoraSpec(rank=4, alpha=-1e300), limits)
