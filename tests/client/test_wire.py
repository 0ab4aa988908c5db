"""The codec: exact round trips, chunking within budget, and clear errors on bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tinker import types as tt

from twinkle_client import wire
from twinkle_client._proto.twinkle.v1 import common_pb2 as pb


def _roundtrip(tensor: pb.Tensor) -> np.ndarray:
    return wire.decode_array(pb.Tensor.FromString(tensor.SerializeToString()))


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5), (2, 3, 4)])
def test_numpy_arrays_round_trip_exactly(dtype, shape):
    rng = np.random.default_rng(0)
    array = (rng.standard_normal(shape) * 1000).astype(dtype)
    out = _roundtrip(wire.encode_array(array))
    assert out.dtype == np.dtype(dtype) and out.shape == shape
    np.testing.assert_array_equal(out, array)


def test_bfloat16_torch_tensor_round_trips_to_float32_values():
    tensor = torch.randn(4, 6).to(torch.bfloat16)
    encoded = wire.encode_array(tensor)
    assert encoded.dtype == pb.BFLOAT16 and len(encoded.data) == 4 * 6 * 2
    np.testing.assert_array_equal(_roundtrip(encoded), tensor.float().numpy())


def test_sparse_target_tokens_as_tinker_builds_them_round_trip():
    dense = torch.zeros(6, 4, dtype=torch.int64)
    dense[1, 2], dense[4, 0], dense[5, 3] = 17, 3, 9
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints([1, 2, 3, 4, 5, 6]),
        loss_fn_inputs={"target_tokens": dense, "weights": (dense > 0).float()},
    )
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    encoded = wire.encode_tinker_datum(datum)
    assert encoded.loss_inputs["target_tokens"].sparse_crow_indices
    ids, inputs = wire.decode_datum(pb.Datum.FromString(encoded.SerializeToString()))
    np.testing.assert_array_equal(ids, [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(inputs["target_tokens"], dense.numpy())
    np.testing.assert_array_equal(inputs["weights"], (dense > 0).float().numpy())


def test_tinker_datum_round_trips_through_decode_and_tensor_data():
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 0.5, 2.0],
                        "advantages": [1.0, -1.0, 0.25]},
    )
    encoded = wire.encode_tinker_datum(datum)
    ids, inputs = wire.decode_datum(encoded)
    assert ids.dtype == np.int64 and inputs["target_tokens"].dtype == np.int64
    np.testing.assert_array_equal(inputs["weights"], [0.0, 0.5, 2.0])
    back = wire.decode_tensor_data(encoded.loss_inputs["advantages"])
    assert back.dtype == "float32" and back.tolist() == [1.0, -1.0, 0.25]


def test_empty_datum_round_trips():
    ids, inputs = wire.decode_datum(wire.encode_datum(np.zeros(0, np.int64), {}))
    assert ids.shape == (0,) and inputs == {}


def test_maximal_token_id_round_trips():
    top = np.iinfo(np.int32).max
    ids, inputs = wire.decode_datum(wire.encode_datum([0, top], {"target_tokens": [top, 0]}))
    assert ids.tolist() == [0, top] and inputs["target_tokens"].tolist() == [top, 0]


def test_feature_with_shifted_labels_becomes_target_tokens_and_weights_and_back():
    feature = {"input_ids": [10, 11, 12, 13], "labels": [-100, -100, 13, 2],
               "advantages": 0.5, "old_logps": [0.0, 0.0, -1.0, -2.0]}
    ids, inputs = wire.decode_datum(wire.encode_feature(feature))
    np.testing.assert_array_equal(inputs["target_tokens"], [0, 0, 13, 2])
    np.testing.assert_array_equal(inputs["weights"], [0, 0, 1, 1])
    np.testing.assert_array_equal(inputs["advantages"], [0.5] * 4)
    back = wire.loss_inputs_to_feature(ids, inputs)
    np.testing.assert_array_equal(back["labels"], feature["labels"])
    np.testing.assert_array_equal(back["old_logps"], feature["old_logps"])



def test_feature_weights_scale_labelled_positions_and_are_zero_where_labels_are_ignored():
    feature = {"input_ids": [10, 11, 12, 13], "labels": [-100, -100, 13, 2],
               "weights": [1.0, 1.0, 0.5, 2.0]}
    _, inputs = wire.feature_to_loss_inputs(feature)
    np.testing.assert_array_equal(inputs["weights"], [0.0, 0.0, 0.5, 2.0])
    with pytest.raises(wire.WireError, match=r"feature\[0\].weights: has shape \[3\]"):
        wire.feature_to_loss_inputs({**feature, "weights": [1.0, 1.0, 1.0]})
    with pytest.raises(wire.WireError, match=r"feature\[0\].weights: given without 'labels'"):
        wire.feature_to_loss_inputs({"input_ids": [1, 2], "weights": [1.0, 1.0]})


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: wire.encode_datum([1.5, 2.0], {}), "input_ids: token ids must be integers"),
        (lambda: wire.encode_datum([1, -3], {}), "input_ids: token ids must be non-negative"),
        (lambda: wire.encode_datum([1, 2, 3], {"weights": [1.0, 1.0]}),
         "loss_inputs['weights']: first dimension is 2 but input_ids has 3"),
        (lambda: wire.encode_feature({"input_ids": [1, 2], "labels": [2]}), "feature[0].labels"),
        (lambda: wire.encode_array(np.array(["a"])), "is not supported on the wire"),
        (lambda: wire.encode_array(np.zeros(2, np.complex64), field="x"), "x: dtype complex64"),
    ],
)
def test_bad_client_input_names_the_field(build, field):
    with pytest.raises(wire.WireError, match=field.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        build()


def test_declared_shape_larger_than_payload_is_rejected_before_allocation():
    huge = pb.Tensor(dtype=pb.FLOAT32, shape=[1 << 40], data=b"\0" * 8)
    with pytest.raises(wire.WireError, match="holds 8 bytes"):
        wire.decode_array(huge, "weights")


def test_negative_dimension_and_unknown_dtype_are_rejected():
    with pytest.raises(wire.WireError, match="negative dimension"):
        wire.decode_array(pb.Tensor(dtype=pb.INT64, shape=[-1], data=b""))
    with pytest.raises(wire.WireError, match="unknown dtype tag"):
        wire.decode_array(pb.Tensor(dtype=99, shape=[0], data=b""))


def test_server_side_decode_rejects_float_token_ids_and_length_disagreement():
    datum = wire.encode_datum([1, 2], {})
    datum.input_ids.CopyFrom(wire.encode_array(np.array([1.0, 2.0], np.float32)))
    with pytest.raises(wire.WireError, match=r"datum\[3\].input_ids: dtype must be INT32"):
        wire.decode_datum(datum, index=3)
    datum = wire.encode_datum([1, 2], {"weights": [1.0, 1.0]})
    datum.loss_inputs["target_tokens"].CopyFrom(wire.encode_array(np.array([1, 2, 3])))
    with pytest.raises(wire.WireError, match="first dimension is 3 but input_ids has 2"):
        wire.decode_datum(datum)
    datum = wire.encode_datum([1, 2], {"target_tokens": np.array([1.0, 2.0], np.float32)})
    with pytest.raises(wire.WireError, match="target_tokens'\\]: token ids must be INT32"):
        wire.decode_datum(datum)


def test_malformed_csr_is_rejected():
    bad = pb.Tensor(dtype=pb.INT64, shape=[2, 2], data=np.array([1], "<i8").tobytes(),
                    sparse_crow_indices=np.array([0, 1], "<i8").tobytes(),
                    sparse_col_indices=np.array([0], "<i8").tobytes())
    with pytest.raises(wire.WireError, match="sparse_crow_indices must hold 3"):
        wire.decode_array(bad, "target_tokens")
    bad.sparse_crow_indices = np.array([0, 1, 1], "<i8").tobytes()
    bad.sparse_col_indices = np.array([5], "<i8").tobytes()
    with pytest.raises(wire.WireError, match=r"sparse_col_indices must lie in \[0, 2\)"):
        wire.decode_array(bad, "target_tokens")


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 200), min_size=0, max_size=40),
       budget=st.integers(4_000, 20_000))
def test_chunks_stay_within_budget_and_reassemble_in_order(lengths, budget):
    datums = [wire.encode_datum(np.arange(n) % 50,
                                {"target_tokens": np.arange(n) % 50,
                                 "weights": np.ones(n, np.float32)}, i)
              for i, n in enumerate(lengths)]
    chunks = list(wire.chunk_datums(datums, budget))
    for chunk in chunks:
        assert chunk
        assert sum(d.ByteSize() + 16 for d in chunk) <= budget
    assert [d for chunk in chunks for d in chunk] == datums


def test_datum_over_the_chunk_budget_raises_naming_it():
    datums = [wire.encode_datum(np.arange(10), {}), wire.encode_datum(np.arange(5000), {}, 1)]
    with pytest.raises(wire.WireError, match=r"datum\[1\]: encodes to \d+ bytes, over the 1000"):
        list(wire.chunk_datums(datums, 1000))
