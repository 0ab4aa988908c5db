"""stable_reinforce through `tinker_compat` over gRPC: `record_stability_info` sampling
clients, datums with provenance as the cookbook's `rl_loop` builds them, and refusals
that name datum and span with nothing applied."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from tinker_compat import errors

from ..http.test_stable_reinforce import group_data, sample_group

pytestmark = pytest.mark.integration
ADAM = types.AdamParams(learning_rate=1e-2)


def _probe(training) -> float:
    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 17, 42, 99]),
                        loss_fn_inputs={"target_tokens": np.array([17, 42, 99, 3]),
                                        "weights": np.ones(4, np.float32)})]
    return training.forward(data, "cross_entropy").result().metrics["loss:sum"]


def test_stable_reinforce_over_grpc(service_client):
    training = service_client.create_lora_training_client(base_model="tiny", rank=8,
                                                          seed=5).result()
    snapshot = training.save_weights_and_get_sampling_client(record_stability_info=True)
    seqs = sample_group(snapshot.result())
    assert len({s.sequence_id for s in seqs}) == len(seqs)
    path = training.save_weights_for_sampler("sr").result().path
    named = training.create_sampling_client(path, record_stability_info=True).result()
    seqs += sample_group(named, 2)
    before = _probe(training)
    out = training.forward_backward(group_data(seqs), "stable_reinforce").result()
    assert np.isfinite(out.metrics["loss:sum"])
    assert out.metrics["ratio:mean"] == pytest.approx(1.0, abs=1e-3)  # on-policy, float32
    training.optim_step(ADAM).result()
    assert _probe(training) != before

    # Refused, naming datum and span; nothing applied on a client that saw only refusals;
    # its later ops still run.
    untouched = service_client.create_lora_training_client(base_model="tiny", rank=8,
                                                           seed=6).result()
    data = group_data(seqs)
    d = data[1]
    spans = [types.PromptProvenanceSpan(sequence_id="seq-unknown", length=6),
             *d.model_input_spans[1:]]
    data[1] = types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs,
                          model_input_spans=spans, loss_fn_input_spans=d.loss_fn_input_spans)
    before = _probe(untouched)
    with pytest.raises(errors.NotFoundError,
                       match=r"datum\[1\]\.model_input_spans\[0\]\.sequence_id: no recorded "
                             "sequence 'seq-unknown'"):
        untouched.forward_backward(data, "stable_reinforce").result()
    plain = training.save_weights_and_get_sampling_client().result()
    with pytest.raises(errors.NotFoundError, match=r"datum\[0\]\.model_input_spans\[0\]"):
        untouched.forward_backward(group_data(sample_group(plain, 1)),
                                   "stable_reinforce").result()
    with pytest.raises(errors.BadRequestError, match=r"datum\[0\]: stable_reinforce needs "
                                                     "provenance"):
        untouched.forward_backward(group_data(seqs, provenance=False),
                                   "stable_reinforce").result()
    untouched.optim_step(ADAM).result()
    assert _probe(untouched) == before
