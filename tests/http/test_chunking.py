"""A batch over `--max-batch-tokens` on both fronts: the client config the server sends
makes the stock SDK cut every forward_backward chunk (one request each) within the cap,
and `tinker_compat` splits its ops by it; both give the one-batch numbers."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tinker_compat import ServiceClient as CompatServiceClient
from twinkle_server.http.app import fwdbwd_chunking
from twinkle_server.process import start_server

from ..numerics import LOGPROB_ATOL, LOSS_RTOL
from .conftest import sft_data

pytestmark = pytest.mark.integration
MAX_BATCH_TOKENS = 2048
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache):
    proc = start_server(tmp_path_factory.mktemp("chunking"), "--max-batch-tokens",
                        str(MAX_BATCH_TOKENS), http=True)
    yield proc
    proc.stop()


def test_the_chunk_caps_keep_any_chunk_within_max_batch_tokens():
    # Every token counts at least 4 bytes in the SDK's estimate.
    assert fwdbwd_chunking(262_144) == {"fwdbwd_max_chunk_bytes_count": 1_048_576,
                                        "fwdbwd_max_chunk_len": 1024}
    assert fwdbwd_chunking(10**7) == {"fwdbwd_max_chunk_bytes_count": 5_000_000,
                                      "fwdbwd_max_chunk_len": 1024}
    assert fwdbwd_chunking(100)["fwdbwd_max_chunk_len"] == 100


def test_a_batch_over_the_cap_trains_alike_through_the_sdk_and_the_shim(server):
    # 40 x 100 = 4,000 tokens, 64 KB: one chunk by the SDK's own caps (1,024 datums, 5 MB).
    data = sft_data(40, length=100)
    assert sum(d.model_input.length for d in data) > MAX_BATCH_TOKENS
    sdk = tinker.ServiceClient(base_url=f"http://{server.http_address}", api_key="tml-open")
    shim = CompatServiceClient(base_url=f"http://{server.address}")
    try:
        config = sdk.holder._client_config
        assert config.fwdbwd_max_chunk_bytes_count == 4 * MAX_BATCH_TOKENS
        outputs = {}
        for name, client in (("sdk", sdk), ("shim", shim)):
            tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
            first = tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(ADAM).result()
            after = tc.forward(data, "cross_entropy").result()
            outputs[name] = (first, after)
        for first, after in outputs.values():
            assert len(first.loss_fn_outputs) == 40
            assert after.metrics["loss:sum"] < first.metrics["loss:sum"]
        for index in (0, 1):
            a, b = outputs["sdk"][index], outputs["shim"][index]
            assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=LOSS_RTOL)
            np.testing.assert_allclose(a.loss_fn_outputs[-1]["logprobs"].to_numpy(),
                                       b.loss_fn_outputs[-1]["logprobs"].to_numpy(),
                                       atol=LOGPROB_ATOL, rtol=0)
    finally:
        shim.close()
        sdk.close("success").result()


def _out_of_vocab(length: int = 100) -> types.Datum:
    ids = list(range(5, 5 + length))
    return types.Datum(model_input=types.ModelInput.from_ints(ids),
                       loss_fn_inputs={"target_tokens": np.array(ids[1:] + [10**6], np.int64),
                                       "weights": np.ones(length, np.float32)})


@pytest.mark.parametrize("bad_at", ["first", "last"])
def test_a_chunked_forward_backward_with_a_bad_datum_fails_whole_and_its_step_applies_nothing(
        server, bad_at):
    """A bad datum in one chunk of a batch the SDK cuts into several: the call fails naming
    it (a later chunk refused at once left the SDK's first chunk unsent and the model's
    queue waiting for good); the step sent after it is refused and applies nothing of the
    other chunks' gradients (weights as before: the same loss, to the rounding of a pass
    that may be merged with other tests' ones, LOSS_RTOL); the next batch trains."""
    data = sft_data(12, length=100)
    data = [_out_of_vocab(), *data] if bad_at == "first" else [*data, _out_of_vocab()]
    sdk = tinker.ServiceClient(base_url=f"http://{server.http_address}", api_key="tml-open")
    try:
        tc = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        probe = sft_data(2, length=30, seed=9)
        before = tc.forward(probe, "cross_entropy").result(timeout=60).metrics["loss:sum"]
        failed = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(ADAM)
        with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
            failed.result(timeout=60)
        with pytest.raises(tinker.RequestFailedError,
                           match="a forward_backward since the last step failed"):
            step.result(timeout=60)
        after = tc.forward(probe, "cross_entropy").result(timeout=60).metrics["loss:sum"]
        assert after == pytest.approx(before, rel=LOSS_RTOL)
        tc.forward_backward(sft_data(12, length=100), "cross_entropy").result(timeout=60)
        assert tc.optim_step(ADAM).result(timeout=60).metrics is not None
        trained = tc.forward(probe, "cross_entropy").result(timeout=60).metrics["loss:sum"]
        assert trained < before
    finally:
        sdk.close("success").result()
