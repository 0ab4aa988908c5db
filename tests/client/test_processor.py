"""The input processor: every input shape gives the same per-sequence features, padding is
stripped exactly by the attention mask, and shapes that do not fit fail naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from twinkle_client.processor import InputProcessor, ProcessorError, make_processor, to_features

from .conftest import toy_features


def _ragged(seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Features of different lengths (5, 9, 7), with per-token old_logps."""
    rng = np.random.default_rng(seed)
    out = []
    for length in (5, 9, 7):
        labels = rng.integers(3, 100, length)
        labels[:2] = -100
        out.append({"input_ids": rng.integers(3, 100, length), "labels": labels,
                    "old_logps": rng.standard_normal(length).astype(np.float32)})
    return out


def _same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert sorted(g) == sorted(w)
        for key in w:
            np.testing.assert_array_equal(np.asarray(g[key]), np.asarray(w[key]))


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_numpy_batch_strips_to_the_original_features(side):
    features = _ragged()
    batch = InputProcessor(side, pad_token_id=1).collate(features)
    assert batch["input_ids"].shape == (3, 9)
    assert batch["attention_mask"].sum(1).tolist() == [5, 9, 7]
    _same(to_features(batch), features)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_torch_batch_strips_to_the_same_features(side):
    features = _ragged(1)
    batch = {k: torch.from_numpy(v) for k, v in InputProcessor(side).collate(features).items()}
    got = to_features(batch)
    assert all(isinstance(f["input_ids"], torch.Tensor) for f in got)
    _same(got, features)


def test_list_of_features_single_feature_and_list_batch_agree():
    features = _ragged(2)
    _same(to_features(features), features)
    _same(to_features(features[1]), [features[1]])
    as_lists = {"input_ids": [f["input_ids"].tolist() for f in features],
                "labels": [f["labels"].tolist() for f in features]}
    _same(to_features(as_lists), [{k: f[k] for k in ("input_ids", "labels")} for f in features])


def test_a_single_feature_with_its_own_mask_keeps_exactly_the_masked_positions():
    feature = {"input_ids": [0, 0, 5, 6, 7], "labels": [-100, -100, 6, 7, 8],
               "attention_mask": [0, 0, 1, 1, 1]}
    assert to_features(feature) == [{"input_ids": [5, 6, 7], "labels": [6, 7, 8]}]


def test_per_sequence_advantages_stay_one_value_per_row_and_extra_keys_follow_rows():
    features = toy_features(3, length=6)
    batch = InputProcessor().collate(features)
    batch["advantages"] = np.array([0.5, -1.0, 2.0])
    batch["position_ids"] = np.tile(np.arange(6), (3, 1))
    batch["source"] = ["a", "b", "c"]
    got = to_features(batch)
    assert [float(f["advantages"]) for f in got] == [0.5, -1.0, 2.0]
    assert [f["source"] for f in got] == ["a", "b", "c"]
    assert all("position_ids" not in f and "attention_mask" not in f for f in got)


def test_collate_then_strip_is_exact_for_random_lengths_on_both_sides():
    rng = np.random.default_rng(3)
    for side in ("left", "right"):
        features = [{"input_ids": rng.integers(0, 50, n), "labels": rng.integers(0, 50, n)}
                    for n in rng.integers(1, 20, 8)]
        _same(to_features(InputProcessor(side).collate(features)), features)


@pytest.mark.parametrize("inputs, match", [
    ([], r"inputs: the batch is empty"),
    ({"labels": [[1, 2]]}, r"inputs: missing 'input_ids'"),
    ([{"labels": [1]}], r"inputs\[0\]: missing 'input_ids'"),
    ("text", r"inputs: expected a feature dict"),
    ({"input_ids": np.zeros((2, 2, 2), np.int64)}, r"input_ids: must be one sequence \(1-D\) "
                                                   r"or a batch \(2-D\), got 3"),
    ({"input_ids": [[1, 2, 3]], "labels": [[1, 2]]}, r"inputs\[0\].labels: has 2 positions "
                                                     r"but input_ids has 3"),
    ({"input_ids": [[1, 2], [3, 4]], "labels": [[1, 2]]}, r"inputs.labels: has 1 rows but "
                                                          r"input_ids has 2"),
    ({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 0, 1]]},
     r"attention_mask\[0\]: the ones are not contiguous"),
    ({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 2, 1]]},
     r"attention_mask\[0\]: must hold only 0 and 1"),
    ({"input_ids": [[1, 2, 3]], "attention_mask": [[0, 0, 0]]},
     r"attention_mask\[0\]: masks out every position"),
    ({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1]]},
     r"attention_mask\[0\]: has shape \[2\] but the row's input_ids has 3 positions"),
    ({"input_ids": np.zeros((0, 4), np.int64)}, r"inputs.input_ids: the batch is empty"),
    ([{"input_ids": [[1, 2]]}], r"inputs\[0\].input_ids: must be one sequence"),
])
def test_bad_shapes_raise_a_processor_error_naming_the_field(inputs, match):
    with pytest.raises(ProcessorError, match=match):
        to_features(inputs)


def test_processor_settings_are_checked_and_resolved_by_name_class_or_instance():
    with pytest.raises(ProcessorError, match="padding_side: 'middle' is not one of"):
        InputProcessor("middle")
    assert make_processor("InputProcessor", padding_side="left").padding_side == "left"
    assert make_processor(InputProcessor, padding_side="left").padding_side == "left"
    instance = InputProcessor()
    assert make_processor(instance) is instance
    with pytest.raises(ProcessorError, match="processor: 'Collator' is not one of"):
        make_processor("Collator")
    with pytest.raises(ProcessorError, match="kwargs are only for a name or a class"):
        make_processor(instance, padding_side="left")


def test_collate_refuses_features_with_different_fields():
    features = toy_features(2)
    features[1]["old_logps"] = np.zeros(12, np.float32)
    with pytest.raises(ProcessorError, match=r"features\[1\]: has fields"):
        InputProcessor().collate(features)
