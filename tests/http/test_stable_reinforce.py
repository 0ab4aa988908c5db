"""stable_reinforce and gspo through the stock `tinker` SDK over HTTP: sampling with
`record_stability_info`, datums built as the cookbook's `rl_loop` builds them
(`Datum.with_provenance`), and provenance that names nothing, another tenant's or
another session's sequence, or does not tile, refused with nothing applied."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.integration
ADAM = types.AdamParams(learning_rate=1e-2)
PROMPT = [5, 17, 42, 99, 7, 23]
PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=0, stop=[])


def rl_datum(prompt: list[int], seq: types.SampledSequence, advantage: float,
             provenance: bool = True) -> types.Datum:
    """One datum exactly as `tinker_cookbook.recipes.rl_loop` builds it."""
    sampled = seq.tokens
    ob_len = len(prompt) - 1
    model_input = types.ModelInput.from_ints(prompt + sampled[:-1])
    datum = types.Datum(model_input=model_input, loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.array([0] * ob_len + sampled)),
        "logprobs": types.TensorData.from_numpy(
            np.array([0.0] * ob_len + seq.logprobs, np.float32)),
        "advantages": types.TensorData.from_numpy(
            np.array([0.0] * ob_len + [advantage] * len(sampled), np.float32)),
    })
    if not provenance:
        return datum
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1,
                                                   length=len(prompt) - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled))])


def sample_group(sampler, n: int = 4) -> list[types.SampledSequence]:
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), n, PARAMS).result()
    return result.sequences


def group_data(seqs, provenance: bool = True) -> list[types.Datum]:
    advantages = np.linspace(-1.0, 1.0, len(seqs))
    return [rl_datum(PROMPT, s, float(a), provenance)
            for s, a in zip(seqs, advantages, strict=True)]


@pytest.fixture(scope="module")
def training(service):
    return service.create_lora_training_client(base_model="tiny", rank=8, seed=5).result()


@pytest.fixture(scope="module")
def recorded(training):
    sampler = training.save_weights_and_get_sampling_client(
        record_stability_info=True).result()
    return sample_group(sampler)


def _probe(training) -> float:
    """A fixed forward's loss: moves exactly when the adapter's weights do."""
    data = [types.Datum(model_input=types.ModelInput.from_ints(PROMPT),
                        loss_fn_inputs={"target_tokens": np.array(PROMPT[1:] + [3]),
                                        "weights": np.ones(len(PROMPT), np.float32)})]
    return training.forward(data, "cross_entropy").result().metrics["loss:sum"]


def test_sampled_sequences_carry_distinct_ids(recorded):
    ids = [s.sequence_id for s in recorded]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids)


def test_stable_reinforce_trains_on_recorded_sequences(training, recorded):
    before = _probe(training)
    out = training.forward_backward(group_data(recorded), "stable_reinforce",
                                    loss_fn_config={"kl_coeff": 0.1}).result()
    assert np.isfinite(out.metrics["loss:sum"])
    # On-policy (the sampler is these very weights): ratio 1 up to float32 rounding of
    # the sampler's and the trainer's logprobs (different code paths: 1e-3 is generous).
    assert out.metrics["ratio:mean"] == pytest.approx(1.0, abs=1e-3)
    assert out.metrics["tokens:sum"] == sum(len(s.tokens) for s in recorded)
    training.optim_step(ADAM).result()
    assert _probe(training) != before


def test_gspo_trains_with_its_sequence_ratio_mask(training, recorded):
    data = []
    for datum in group_data(recorded, provenance=False):
        n = datum.model_input.length
        mask = np.r_[np.zeros(len(PROMPT) - 1), np.ones(n - len(PROMPT) + 1)]
        data.append(types.Datum(model_input=datum.model_input, loss_fn_inputs={
            **datum.loss_fn_inputs, "sequence_ratio_mask": mask.astype(np.float32)}))
    out = training.forward_backward(data, "gspo").result()
    assert np.isfinite(out.metrics["loss:sum"])
    training.optim_step(ADAM).result()


@pytest.fixture(scope="module")
def untouched(service):
    """A client in the same session that only ever sees refused requests: with no
    gradient and no optimizer state, an optimizer step changes nothing."""
    return service.create_lora_training_client(base_model="tiny", rank=8, seed=6).result()


def _refused(training, data, match):
    """The request fails naming datum and span (through its future: a refused chunk of a
    forward_backward fails in its turn); nothing is applied (the probe's loss does not
    move after an optimizer step on a client whose only requests were refused) and the
    training client's later ops still run (the refused op took its seq_id)."""
    before = _probe(training)
    with pytest.raises(tinker.RequestFailedError, match=match):
        training.forward_backward(data, "stable_reinforce").result()
    training.optim_step(ADAM).result()   # no gradient was accumulated: nothing moves
    assert _probe(training) == before


def test_unknown_sequence_id_is_not_found_naming_datum_and_span(untouched, recorded):
    data = group_data(recorded)
    bad = data[2]
    spans = list(bad.loss_fn_input_spans)
    spans[1] = types.SampledProvenanceSpan(sequence_id="seq-nope", length=spans[1].length)
    data[2] = types.Datum(model_input=bad.model_input, loss_fn_inputs=bad.loss_fn_inputs,
                          model_input_spans=bad.model_input_spans, loss_fn_input_spans=spans)
    _refused(untouched, data,
             r"datum\[2\]\.loss_fn_input_spans\[1\]\.sequence_id: no recorded sequence "
             "'seq-nope'")


def test_unrecorded_samples_cannot_be_trained_on(training, untouched):
    plain = training.save_weights_and_get_sampling_client().result()
    _refused(untouched, group_data(sample_group(plain, 2)),
             r"datum\[0\]\.model_input_spans\[0\]\.sequence_id: no recorded sequence")


def test_spans_that_do_not_tile_or_match_are_invalid(untouched, recorded):
    data = group_data(recorded)
    d = data[1]
    short = [*d.loss_fn_input_spans[:-1], types.SampledProvenanceSpan(
        sequence_id=recorded[1].sequence_id, length=len(recorded[1].tokens) - 1)]
    data[1] = types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs,
                          model_input_spans=d.model_input_spans, loss_fn_input_spans=short)
    _refused(untouched, data,
             r"datum\[1\]\.loss_fn_input_spans: the spans cover \d+ positions but "
             r"target_tokens has \d+")
    data = group_data(recorded)
    d = data[0]
    past = [d.model_input_spans[0], types.SampledProvenanceSpan(
        sequence_id=recorded[0].sequence_id, offset=1, length=len(recorded[0].tokens) - 1)]
    data[0] = types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs,
                          model_input_spans=past, loss_fn_input_spans=d.loss_fn_input_spans)
    _refused(untouched, data,
             r"datum\[0\]\.model_input_spans\[1\]: input_ids\[\d+\] is \d+ but sequence "
             r"'seq-\w+''s sampled token \d+ is \d+|datum\[0\]\.model_input_spans\[1\]: "
             r"positions \[1, \d+\) are outside")
    # A sampled target that is not the recorded token.
    data = group_data(recorded)
    d = data[3]
    targets = d.loss_fn_inputs["target_tokens"].to_numpy().copy()
    targets[-1] = (targets[-1] + 1) % 100 + 3
    data[3] = types.Datum(model_input=d.model_input,
                          loss_fn_inputs={**d.loss_fn_inputs, "target_tokens":
                                          types.TensorData.from_numpy(targets)},
                          model_input_spans=d.model_input_spans,
                          loss_fn_input_spans=d.loss_fn_input_spans)
    _refused(untouched, data,
             r"datum\[3\]\.loss_fn_input_spans\[1\]: target_tokens\[\d+\] is \d+ but "
             r"sequence 'seq-\w+''s sampled token \d+ is \d+")
    # Non-zero advantage on a prompt position.
    data = group_data(recorded)
    d = data[0]
    adv = d.loss_fn_inputs["advantages"].to_numpy().copy()
    adv[0] = 1.0
    data[0] = types.Datum(model_input=d.model_input,
                          loss_fn_inputs={**d.loss_fn_inputs, "advantages":
                                          types.TensorData.from_numpy(adv)},
                          model_input_spans=d.model_input_spans,
                          loss_fn_input_spans=d.loss_fn_input_spans)
    _refused(untouched, data,
             r"datum\[0\]\.loss_fn_input_spans\[0\]: a prompt span's positions carry "
             "non-zero advantages")


def test_stable_reinforce_needs_provenance(untouched, recorded):
    _refused(untouched, group_data(recorded, provenance=False),
             r"datum\[0\]: stable_reinforce needs provenance")


def test_expired_records_are_not_found(server, training, untouched):
    sampler = training.save_weights_and_get_sampling_client(
        record_stability_info=True).result()
    seqs = sample_group(sampler, 2)
    # A day and a second since last use: what the server would see tomorrow.
    with sqlite3.connect(server.data_dir / "twinkle.db") as db:
        db.execute("UPDATE stability_records SET last_used_at = last_used_at - 86401 "
                   "WHERE sequence_id = ?", (seqs[1].sequence_id,))
    _refused(untouched, group_data(seqs),
             r"datum\[1\]\.model_input_spans\[0\]\.sequence_id: no recorded sequence")


def test_another_tenants_sequences_cannot_be_trained_on(bob, recorded):
    theirs = bob.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    _refused(theirs, group_data(recorded),
             r"datum\[0\]\.model_input_spans\[0\]\.sequence_id: no recorded sequence")
