"""The seed rule over the stock SDK: with `--batch-invariant on`, a tenant's seeded sample
gives the same tokens and logprobs, bit for bit, alone and while other tenants decode
long requests of other lengths; with it off, what may differ is stated and bounded."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import tinker
from tinker import types

from ..numerics import LOGPROB_ATOL
from .conftest import keyed_server, sft_data

pytestmark = pytest.mark.integration

PROMPT = types.ModelInput.from_ints([31, 7, 402, 18, 99, 5, 260, 1033, 4])
MINE = types.SamplingParams(max_tokens=40, seed=11, temperature=1.0)


@pytest.fixture(scope="module")
def invariant(tmp_path_factory, tiny_cache):
    proc = keyed_server(tmp_path_factory.mktemp("invariant-server"), "--batch-invariant", "on")
    yield proc
    proc.stop()


def _clients(proc) -> tuple[tinker.ServiceClient, tinker.ServiceClient]:
    url = f"http://{proc.http_address}"
    return (tinker.ServiceClient(base_url=url, api_key=proc.keys["alice"]),
            tinker.ServiceClient(base_url=url, api_key=proc.keys["bob"]))


def _trained_sampler(service: tinker.ServiceClient, seed: int) -> tinker.SamplingClient:
    training = service.create_lora_training_client(base_model="tiny", rank=8,
                                                   seed=seed).result()
    training.forward_backward(sft_data(), "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return training.save_weights_and_get_sampling_client().result()


def _alone_then_in_company(service, other) -> tuple[list, list]:
    """Alice's seeded sample alone, then the same request sent while bob's sampler and
    the base decode long requests of other lengths (sent first, still decoding when hers
    finishes)."""
    mine = _trained_sampler(service, seed=3)
    alone = mine.sample(PROMPT, 2, MINE).result().sequences
    theirs = _trained_sampler(other, seed=4)
    base = other.create_sampling_client(base_model="tiny").result()
    busy: list[Future] = [
        theirs.sample(types.ModelInput.from_ints(list(range(40, 40 + length))), n,
                      types.SamplingParams(max_tokens=tokens, seed=length))
        for length, n, tokens in ((3, 4, 120), (57, 1, 100), (18, 2, 110))]
    busy.append(base.sample(types.ModelInput.from_ints([9] * 25), 3,
                            types.SamplingParams(max_tokens=100, seed=1)))
    beside = mine.sample(PROMPT, 2, MINE).result().sequences
    for future in busy:
        future.result()
    return alone, beside


def test_a_seeded_sample_is_the_same_bit_for_bit_beside_other_tenants(invariant):
    service, other = _clients(invariant)
    alone, beside = _alone_then_in_company(service, other)
    assert [s.tokens for s in alone] == [s.tokens for s in beside]
    assert [np.float32(s.logprobs).tobytes() for s in alone] == \
        [np.float32(s.logprobs).tobytes() for s in beside]
    assert [s.stop_reason for s in alone] == [s.stop_reason for s in beside]


def test_with_the_mode_off_company_may_change_the_last_bits(service, bob):
    """`--batch-invariant off` (the package's server): beside others, the same request
    gives the same tokens up to where a draw lands within rounding of a boundary, and
    logprobs within LOGPROB_ATOL (float32 rounding of a pass: tests/numerics.py) up to
    there; the bits may differ, depending on the CPU's kernels."""
    alone, beside = _alone_then_in_company(service, bob)
    for a, b in zip(alone, beside, strict=True):
        parted = next((i for i, (s, t) in enumerate(zip(a.tokens, b.tokens, strict=True))
                       if s != t), len(a.tokens))
        np.testing.assert_allclose(a.logprobs[:parted], b.logprobs[:parted], rtol=0,
                                   atol=LOGPROB_ATOL)
        print(f"--batch-invariant off: tokens agree for {parted} of {len(a.tokens)}; "
              f"bit-identical logprobs: {a.logprobs == b.logprobs}")
