"""The codec: exact round trips, chunking within budget, and clear errors on bad input."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tinker import types as tt

import twinkle_wire as wire
from tinker_compat.convert import encode_tinker_datum, tensor_data
from twinkle_client import features
from twinkle_wire._proto.twinkle.v1 import common_pb2 as pb
from twinkle_wire._proto.twinkle.v1 import training_pb2


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


def _through_wire(datums: list[wire.Datum], budget: int = wire.DEFAULT_CHUNK_BYTES
                  ) -> list[wire.Datum]:
    """Datums as the server sees them: chunked, packed, serialized, parsed and unpacked."""
    out: list[wire.Datum] = []
    for group in wire.chunk_datums(datums, budget):
        chunk = training_pb2.ForwardChunk(batch=wire.pack_datums(group))
        parsed = training_pb2.ForwardChunk.FromString(chunk.SerializeToString())
        out.extend(wire.unpack_datums(parsed.batch, len(out)))
    return out


def test_sparse_target_tokens_as_tinker_builds_them_round_trip_dense():
    dense = torch.zeros(6, 4, dtype=torch.int64)
    dense[1, 2], dense[4, 0], dense[5, 3] = 17, 3, 9
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints([1, 2, 3, 4, 5, 6]),
        loss_fn_inputs={"target_tokens": tt.TensorData.from_torch_sparse(dense),
                        "weights": (dense > 0).float()},
    )
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    [out] = _through_wire([encode_tinker_datum(datum)])
    np.testing.assert_array_equal(out.input_ids, [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(out.loss_inputs["target_tokens"], dense.numpy())
    np.testing.assert_array_equal(out.loss_inputs["weights"], (dense > 0).float().numpy())


def test_tinker_datum_round_trips_in_wire_dtypes_and_back_to_tensor_data():
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 0.5, 2.0],
                        "advantages": [1.0, -1.0, 0.25]},
    )
    [out] = _through_wire([encode_tinker_datum(datum)])
    assert out.input_ids.dtype == np.int32 and out.loss_inputs["target_tokens"].dtype == np.int32
    np.testing.assert_array_equal(out.loss_inputs["weights"], [0.0, 0.5, 2.0])
    back = tensor_data(_roundtrip(wire.encode_array(out.loss_inputs["advantages"])))
    assert back.dtype == "float32" and back.tolist() == [1.0, -1.0, 0.25]


def test_empty_datum_round_trips():
    [out] = _through_wire([wire.encode_datum(np.zeros(0, np.int64), {})])
    assert out.input_ids.shape == (0,) and out.loss_inputs == {}


def test_maximal_token_id_round_trips():
    top = np.iinfo(np.int32).max
    [out] = _through_wire([wire.encode_datum([0, top], {"target_tokens": [top, 0]})])
    assert out.input_ids.tolist() == [0, top]
    assert out.loss_inputs["target_tokens"].tolist() == [top, 0]


def test_datums_with_different_loss_inputs_travel_in_separate_batches_in_order():
    datums = [wire.encode_datum([1, 2], {"target_tokens": [2, 3]}),
              wire.encode_datum([4, 5, 6], {"target_tokens": [5, 6, 7], "weights": [1, 0, 1]}),
              wire.encode_datum([7], {"target_tokens": np.array([[8, 9]])}),
              wire.encode_datum([8, 9], {"target_tokens": [9, 10]})]
    assert [len(group) for group in wire.chunk_datums(datums)] == [1, 1, 1, 1]
    out = _through_wire(datums)
    assert [d.input_ids.tolist() for d in out] == [[1, 2], [4, 5, 6], [7], [8, 9]]
    assert out[1].loss_inputs["weights"].tolist() == [1.0, 0.0, 1.0]
    assert out[2].loss_inputs["target_tokens"].tolist() == [[8, 9]]


def test_feature_with_shifted_labels_becomes_target_tokens_and_weights_and_back():
    feature = {"input_ids": [10, 11, 12, 13], "labels": [-100, -100, 13, 2],
               "advantages": 0.5, "old_logps": [0.0, 0.0, -1.0, -2.0]}
    [out] = _through_wire([features.encode_feature(feature)])
    ids, inputs = out.input_ids, out.loss_inputs
    np.testing.assert_array_equal(inputs["target_tokens"], [0, 0, 13, 2])
    np.testing.assert_array_equal(inputs["weights"], [0, 0, 1, 1])
    np.testing.assert_array_equal(inputs["advantages"], [0.5] * 4)
    back = features.loss_inputs_to_feature(ids, inputs)
    np.testing.assert_array_equal(back["labels"], feature["labels"])
    np.testing.assert_array_equal(back["old_logps"], feature["old_logps"])



def test_feature_weights_scale_labelled_positions_and_are_zero_where_labels_are_ignored():
    feature = {"input_ids": [10, 11, 12, 13], "labels": [-100, -100, 13, 2],
               "weights": [1.0, 1.0, 0.5, 2.0]}
    _, inputs = features.feature_to_loss_inputs(feature)
    np.testing.assert_array_equal(inputs["weights"], [0.0, 0.0, 0.5, 2.0])
    with pytest.raises(wire.WireError, match=r"feature\[0\].weights: has shape \[3\]"):
        features.feature_to_loss_inputs({**feature, "weights": [1.0, 1.0, 1.0]})
    with pytest.raises(wire.WireError, match=r"feature\[0\].weights: given without 'labels'"):
        features.feature_to_loss_inputs({"input_ids": [1, 2], "weights": [1.0, 1.0]})


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: wire.encode_datum([1.5, 2.0], {}), "input_ids: token ids must be integers"),
        (lambda: wire.pack_request([wire.encode_datum([1, -3], {})]),
         "datum[0].input_ids: token ids must be non-negative, found -3"),
        (lambda: wire.pack_request([wire.encode_datum([1], {"target_tokens": [2**31]})]),
         "datum[0].loss_inputs['target_tokens']: token id 2147483648 does not fit in int32"),
        (lambda: wire.encode_datum([1], {"target_tokens": np.array([2**63], np.uint64)}),
         "datum[0].loss_inputs['target_tokens']: token id 9223372036854775808 does not fit"),
        (lambda: wire.encode_datum([1, 2, 3], {"weights": [1.0, 1.0]}),
         "loss_inputs['weights']: first dimension is 2 but input_ids has 3"),
        (lambda: features.encode_feature({"input_ids": [1, 2], "labels": [2]}),
         "feature[0].labels"),
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


def test_shapes_numpy_cannot_build_are_wire_errors_even_when_empty():
    with pytest.raises(wire.WireError, match="shape has 70 dimensions, at most 8"):
        wire.decode_array(pb.Tensor(dtype=pb.INT32, shape=[1] * 70, data=b"\0" * 4), "prompt")
    with pytest.raises(wire.WireError, match="weights: shape .* is too large to index"):
        wire.decode_array(pb.Tensor(dtype=pb.FLOAT32, shape=[2, 0, 2**62, 2**62]), "weights")


def test_negative_dimension_and_unknown_dtype_are_rejected():
    with pytest.raises(wire.WireError, match="negative dimension"):
        wire.decode_array(pb.Tensor(dtype=pb.INT64, shape=[-1], data=b""))
    with pytest.raises(wire.WireError, match="unknown dtype tag"):
        wire.decode_array(pb.Tensor(dtype=99, shape=[0], data=b""))


def _batch(*datums: wire.Datum) -> pb.DatumBatch:
    return wire.pack_datums(list(datums))


def _unpack_error(batch: pb.DatumBatch, first: int = 0) -> str:
    with pytest.raises(wire.WireError) as info:
        wire.unpack_datums(batch, first)
    return str(info.value)


def test_server_side_unpack_rejects_bad_batches_naming_the_field():
    floats = _batch(wire.encode_datum([1, 2], {}))
    floats.input_ids.CopyFrom(wire.encode_array(np.array([1.0, 2.0], np.float32)))
    assert "batch.input_ids: dtype must be INT32 or INT64, got FLOAT32" in _unpack_error(floats)
    short = _batch(wire.encode_datum([1, 2], {"weights": [1.0, 1.0]}))
    short.loss_inputs["target_tokens"].CopyFrom(wire.encode_array(np.array([1, 2, 3])))
    assert ("batch.loss_inputs['target_tokens']: first dimension is 3 but input_ids has 2"
            in _unpack_error(short))
    float_targets = _batch(wire.encode_datum([1, 2], {"weights": [1.0, 1.0]}))
    float_targets.loss_inputs["target_tokens"].CopyFrom(wire.encode_array(np.ones(2, np.float32)))
    assert "target_tokens']: token ids must be INT32 or INT64" in _unpack_error(float_targets)
    lengths = _batch(wire.encode_datum([1, 2], {}), wire.encode_datum([3], {}))
    lengths.lengths[1] = 2
    assert "batch.lengths: 2 lengths do not add up to the 3 tokens" in _unpack_error(lengths)
    lengths.lengths[:] = [4, -1]
    assert "datum[8]: length -1 is negative" in _unpack_error(lengths, first=7)


def test_server_side_unpack_names_the_datum_holding_a_bad_token_id():
    batch = _batch(*(wire.encode_datum([1, 2, 3], {"target_tokens": [2, 3, 4]})
                     for _ in range(4)))
    ids = np.array([1, 2, 3] * 4, np.int64)
    ids[7] = -5  # datum 2 (positions 6..8)
    batch.input_ids.CopyFrom(wire.encode_array(ids))
    assert "datum[12].input_ids: token ids must be non-negative, found -5" in _unpack_error(
        batch, first=10)
    ids[7] = 2**31
    batch.input_ids.CopyFrom(wire.encode_array(ids))
    assert "datum[2].input_ids: token id 2147483648 does not fit in int32" in _unpack_error(batch)
    targets = np.array([2, 3, 4] * 4, np.int64)
    targets[11] = -1
    batch.input_ids.CopyFrom(wire.encode_array(np.array([1, 2, 3] * 4, np.int64)))
    batch.loss_inputs["target_tokens"].CopyFrom(wire.encode_array(targets))
    assert "datum[3].loss_inputs['target_tokens']: token ids must be non-negative" in (
        _unpack_error(batch))


def test_pack_converts_hand_built_datums_without_wrapping_token_ids():
    wide = wire.Datum(np.array([1, 2**32 + 5], np.int64), {"target_tokens": np.array([1, 2])})
    with pytest.raises(wire.WireError, match=r"datum\[0\].input_ids: token id 4294967301 "):
        wire.pack_datums([wire.encode_datum([1, 2], {"target_tokens": [1, 2]}), wide][1:])
    fine = wire.Datum(np.array([1, 2], np.int64), {"target_tokens": np.array([3, 4], np.int64),
                                                    "weights": np.array([0.5, 1.0])})
    [out] = wire.unpack_datums(wire.pack_datums([fine]))
    assert out.input_ids.tolist() == [1, 2] and out.loss_inputs["weights"].tolist() == [0.5, 1.0]


def test_pack_keeps_hand_built_columns_exact_whatever_their_dtypes_and_layout():
    # int64 with uint64 would promote to float64 as one column: each converts on its own.
    big = 2**31 - 3
    mixed = [wire.Datum(np.array([1, 2], np.int64),
                        {"target_tokens": np.array([big, 7], np.int64),
                         "weights": np.arange(4, dtype=np.float32)[::2]}),
             wire.Datum(np.array([3, 4], np.uint64),
                        {"target_tokens": np.array([8, big + 1], np.uint64),
                         "weights": np.array([0.25, 0.5], np.float32)})]
    out = wire.unpack_datums(wire.pack_datums(mixed))
    assert [d.loss_inputs["target_tokens"].tolist() for d in out] == [[big, 7], [8, big + 1]]
    assert [d.input_ids.tolist() for d in out] == [[1, 2], [3, 4]]
    assert [d.loss_inputs["weights"].tolist() for d in out] == [[0.0, 2.0], [0.25, 0.5]]
    floats = wire.Datum(np.array([1, 2]), {"target_tokens": np.array([1.0, 2.0])})
    with pytest.raises(wire.WireError, match=r"^datum\[8\].loss_inputs\['target_tokens'\]: "
                                             r"token ids must be integers, got dtype float64$"):
        wire.pack_datums([wire.encode_datum([1, 2], {"target_tokens": [2, 3]}), floats], first=7)


def test_hand_built_datums_of_lists_tensors_and_tensor_data_travel_like_encoded_ones():
    hand = [wire.Datum([1, 2], {"target_tokens": [2, 3], "weights": [1.0, 0.5]}),
            wire.Datum(torch.tensor([3, 4]), {
                "target_tokens": tt.TensorData(data=[4, 5], dtype="int64"),
                "weights": torch.tensor([0.25, 1.0], requires_grad=True)})]
    out = [d for chunk in wire.pack_request(hand) for d in wire.unpack_datums(chunk.batch)]
    assert [d.input_ids.tolist() for d in out] == [[1, 2], [3, 4]]
    assert [d.loss_inputs["target_tokens"].tolist() for d in out] == [[2, 3], [4, 5]]
    assert [d.loss_inputs["weights"].tolist() for d in out] == [[1.0, 0.5], [0.25, 1.0]]


@pytest.mark.parametrize("ids, problem", [(np.array(5), "must be 1-D, got shape []"),
                                          (np.arange(4).reshape(2, 2), "must be 1-D"),
                                          (None, "must be integers, got dtype object")])
def test_hand_built_input_ids_that_are_not_one_sequence_are_refused_naming_the_datum(ids,
                                                                                      problem):
    good, bad = wire.encode_datum([1, 2], {}), wire.Datum(ids, {})
    expected = rf"^datum\[4\].input_ids: token ids {re.escape(problem)}"
    with pytest.raises(wire.WireError, match=expected):
        wire.pack_datums([good, bad], first=3)
    with pytest.raises(wire.WireError, match=expected):
        wire.pack_request([good, bad], first=3)


def test_token_ids_are_checked_a_chunk_at_a_time_and_errors_name_the_datum_in_the_request():
    datums = [wire.encode_datum(np.arange(1, 100), {"target_tokens": np.arange(2, 101)}, i)
              for i in range(40)]
    datums[27] = wire.encode_datum(np.arange(1, 100), {"target_tokens": np.arange(-50, 49)})
    chunks = list(wire.chunk_datums(datums, max_bytes=4096))
    assert len(chunks) > 3 and not any(datums[27] is d for d in chunks[0])
    with pytest.raises(wire.WireError, match=r"^datum\[127\].loss_inputs\['target_tokens'\]: "
                                             r"token ids must be non-negative, found -50$"):
        wire.pack_request(datums, max_bytes=4096, first=100)
    datums[27] = wire.encode_datum(np.arange(1, 100), {"target_tokens": np.arange(2, 101)})
    chunks = wire.pack_request(datums, max_bytes=4096)
    out = [d for chunk in chunks for d in wire.unpack_datums(chunk.batch)]
    assert [d.loss_inputs["target_tokens"].tolist() for d in out] == [
        list(range(2, 101))] * 40


def test_a_bad_token_id_is_reported_with_its_own_datums_value_not_the_chunks_worst():
    datums = [wire.encode_datum([1, 2], {}) for _ in range(6)]
    datums[2] = wire.encode_datum([1, 2**31], {})
    datums[5] = wire.encode_datum([1, -100], {})
    with pytest.raises(wire.WireError, match=r"^datum\[2\].input_ids: token id 2147483648 does "
                                             r"not fit in int32$"):
        wire.pack_request(datums)


def test_a_hand_built_datum_with_a_misaligned_loss_input_is_refused_naming_it():
    good = wire.encode_datum([1, 2, 3], {"weights": np.ones(3, np.float32)})
    short = wire.Datum(np.array([1, 2, 3]), {"weights": np.ones(2, np.float32)})
    with pytest.raises(wire.WireError, match=r"^datum\[4\].loss_inputs\['weights'\]: first "
                                             r"dimension is 2 but input_ids has 3 tokens$"):
        wire.pack_datums([good, short], first=3)


def test_pack_names_datums_by_their_index_in_the_request():
    bad = wire.Datum(np.array([1, 2], np.int32), {"weights": np.array(["x", "y"])})
    with pytest.raises(wire.WireError, match=r"datum\[5\].loss_inputs\['weights'\]: dtype"):
        wire.pack_datums([bad], first=5)


def test_no_chunk_outgrows_the_message_limit_whatever_the_budget():
    datums = [wire.encode_datum(np.arange(300), {"target_tokens": np.arange(300)})] * 2000
    chunks = list(wire.chunk_datums(datums, 64 * 2**20))
    assert len(chunks) > 1
    for chunk in chunks:
        size = training_pb2.ForwardChunk(batch=wire.pack_datums(chunk)).ByteSize()
        assert size <= wire.MAX_MESSAGE_BYTES


def test_pack_refuses_datums_that_do_not_share_loss_inputs():
    with pytest.raises(wire.WireError, match=r"datum\[1\].loss_inputs: keys \['weights'\]"):
        wire.pack_datums([wire.encode_datum([1], {"target_tokens": [1]}),
                          wire.encode_datum([1], {"weights": [1.0]})])
    with pytest.raises(wire.WireError, match=r"datum\[1\].loss_inputs\['target_tokens'\]: "
                                             r"shape \[1, 3\] does not stack"):
        wire.pack_datums([wire.encode_datum([1], {"target_tokens": [[1, 2]]}),
                          wire.encode_datum([1], {"target_tokens": [[1, 2, 3]]})])


def test_prompt_tokens_decode_only_from_integer_tensors():
    assert wire.decode_tokens(wire.encode_array(np.array([3, 4])), "prompt").tolist() == [3, 4]
    with pytest.raises(wire.WireError, match="prompt: dtype must be INT32 or INT64, got FLOAT32"):
        wire.decode_tokens(wire.encode_array(np.array([1.7], np.float32)), "prompt")
    with pytest.raises(wire.WireError, match="prompt: token ids must be non-negative"):
        wire.decode_tokens(wire.encode_array(np.array([-1])), "prompt")


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 200), min_size=0, max_size=40),
       budget=st.integers(4_000, 20_000))
def test_chunks_stay_within_budget_and_reassemble_in_order(lengths, budget):
    datums = [wire.encode_datum(np.arange(n) % 50,
                                {"target_tokens": np.arange(n) % 50 + i,
                                 "weights": np.ones(n, np.float32)}, i)
              for i, n in enumerate(lengths)]
    chunks = list(wire.chunk_datums(datums, budget))
    for chunk in chunks:
        assert chunk
        size = training_pb2.ForwardChunk(batch=wire.pack_datums(chunk)).ByteSize()
        assert size <= budget or len(chunk) == 1
    assert [d for chunk in chunks for d in chunk] == datums
    out = _through_wire(datums, budget)
    assert len(out) == len(datums)
    for got, sent in zip(out, datums, strict=True):
        np.testing.assert_array_equal(got.input_ids, sent.input_ids)
        np.testing.assert_array_equal(got.loss_inputs["target_tokens"],
                                      sent.loss_inputs["target_tokens"])


def test_a_datum_over_the_budget_travels_alone_and_one_over_the_message_limit_raises():
    small, big = wire.encode_datum(np.arange(10), {}), wire.encode_datum(np.arange(5000), {})
    assert [len(group) for group in wire.chunk_datums([small, big, small], 1000)] == [1, 1, 1]
    huge = wire.encode_datum(np.arange(wire.MAX_MESSAGE_BYTES // 4), {}, 1)
    with pytest.raises(wire.WireError, match=r"datum\[1\]: encodes to \d+ bytes, over the "
                                             r"4194304-byte message limit"):
        list(wire.chunk_datums([small, huge], 1000))
