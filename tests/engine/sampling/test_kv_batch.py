"""The KV batch: buffered layers write steps in place and record their used width; joins,
selects and failed steps leave it consistent; each layer kind is named."""

from __future__ import annotations

import pytest
import torch

from twinkle_server.engine.sampling.cache_layers import (
    new_cache,
    sliding_layers,
    unsupported_layers,
)
from twinkle_server.engine.sampling.kv_batch import KVBatch, compaction

from .. import small


def _batch(rows=3, width=5, layers=2):
    cache = new_cache(small.build().config, [(torch.randn(rows, 2, width, 4),
                                               torch.randn(rows, 2, width, 4))] * layers)
    batch = KVBatch(torch.device("cpu"))
    batch.join(cache, torch.ones(rows, width, dtype=torch.long),
               torch.full((rows,), width), torch.zeros(rows, dtype=torch.long))
    return batch


def test_a_reserved_buffer_takes_steps_in_place_and_records_its_width():
    batch = _batch()
    layer = batch.layers()[0]
    before = layer.keys.clone()
    assert layer.spare() == 0 and batch.held() == 3 * 5
    batch.reserve(4)
    assert layer.spare() == 4 and batch.held() == 3 * 9 and torch.equal(layer.keys, before)
    pointer = layer.keys.data_ptr()
    new = torch.randn(3, 2, 1, 4)
    keys, _ = layer.update(new, new)
    assert keys.data_ptr() == pointer and layer.spare() == 3
    assert torch.equal(keys, torch.cat([before, new], dim=-2))
    batch.reserve(4)                    # room left: nothing moves
    assert layer.keys.data_ptr() == pointer


def test_a_layer_without_room_concatenates_as_transformers_does():
    layer = _batch().layers()[0]
    before = layer.keys.clone()
    new = torch.randn(3, 2, 2, 4)
    keys, _ = layer.update(new, new)
    assert torch.equal(keys, torch.cat([before, new], dim=-2)) and layer.spare() == 0


def test_restoring_a_snapshot_undoes_a_step_written_in_place():
    batch = _batch()
    batch.reserve(4)
    saved = batch.snapshot()
    before = [layer.keys.clone() for layer in batch.layers()]
    batch.step_inputs()
    batch.layers()[0].update(torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
    batch.restore(saved)
    assert batch.width == 5 and batch.layers()[0].spare() == 4
    for layer, keys in zip(batch.layers(), before, strict=True):
        assert torch.equal(layer.keys, keys)


def test_selecting_rows_drops_padding_no_kept_row_uses():
    batch = _batch()
    batch.mask[0, :3] = 0              # row 0 is left-padded by 3, the others by none
    batch.select([0])
    assert batch.rows == 1 and batch.width == 2
    assert all(layer.keys.shape[-2] == 2 for layer in batch.layers())
    batch.select([])
    assert batch.rows == 0 and batch.held() == 0


def test_selected_rows_stay_in_their_buffers_so_the_next_step_writes_in_place():
    """A select moves the kept rows within the buffers, which keep their spare columns;
    the next step's reserve then moves nothing. The row it no longer uses stays held
    (`unused`) until the buffers are replaced."""
    batch = _batch()
    batch.reserve(4)
    before = [layer.keys.clone() for layer in batch.layers()]
    layer = batch.layers()[0]
    pointer = layer.keys.data_ptr()
    batch.select([2, 0])
    assert layer.keys.data_ptr() == pointer and batch.unused() == 9
    assert layer.spare() == 4 and torch.equal(layer.keys, before[0][[2, 0]])
    assert batch.held() == 3 * 9
    batch.reserve(4)
    assert layer.keys.data_ptr() == pointer
    new = torch.randn(2, 2, 1, 4)
    keys, _ = layer.update(new, new)
    assert keys.data_ptr() == pointer
    assert torch.equal(keys, torch.cat([before[0][[2, 0]], new], dim=-2))


def test_a_join_that_fails_while_ordering_its_rows_leaves_the_batch_as_it_was():
    """Out of memory while a join puts the rows in order must not leave the new rows in
    the batch (the pool then fails the joiner and decodes on without them). Simulated
    by an order the gather cannot take."""
    batch = _batch(rows=2)
    before = (batch.rows, batch.width, list(batch.group), list(batch.start),
              [layer.keys.clone() for layer in batch.layers()])
    late = _batch(rows=1, width=7)
    with pytest.raises(IndexError):
        batch.join(late.cache, late.mask, late.positions, late.pending, order=[0, 5, 1])
    assert (batch.rows, batch.width, batch.group, batch.start) == before[:4]
    for layer, keys in zip(batch.layers(), before[4], strict=True):
        assert torch.equal(layer.keys, keys)


def test_each_layer_kind_is_named_and_local_attention_is_not_held():
    assert unsupported_layers(small.build().config) == []
    sliding = small.build(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert unsupported_layers(sliding.config) == []
    assert sliding_layers(sliding.config) == ["1: DynamicSlidingWindowLayer"]
    chunked = small.build(layer_types=["chunked_attention", "full_attention"],
                          attention_chunk_size=8)
    assert unsupported_layers(chunked.config) == ["0: chunked_attention"]


@pytest.mark.parametrize(("routes", "keep", "order"), [
    (["a"] * 6, [0, 1, 3, 4, 5], [0, 1, 5, 3, 4]),          # the last row fills the hole
    (["a"] * 6, [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]),          # the last row goes: none moves
    (["a", "a", "b", "b", "b", "c"], [0, 2, 3, 4, 5], [0, 4, 2, 3, 5]),
    (["a", "a", "b", "b", "c", "c"], [1, 2, 3, 4, 5], [1, 3, 2, 5, 4]),
    ([None, None, "b"], [2], [2]),
    (["a", "b"], [], []),
])
def test_a_compaction_keeps_each_routes_rows_together_and_moves_one_row_a_route(
        routes, keep, order):
    """Each route's kept rows stay one run, routes in their order; a row already inside
    its route's new run stays put, so a row that goes costs one move per route after it."""
    assert compaction(routes, keep) == order
    assert sorted(order) == keep


def test_a_select_in_place_keeps_every_kept_rows_columns_and_state():
    """Rows moved within the buffers carry their keys, values, mask, positions and
    pending tokens; a join after it rebuilds the buffers without the unused rows."""
    batch = _batch(rows=5)
    batch.reserve(3)
    batch.mask[1, :2] = 0
    batch.positions = torch.arange(5) * 10
    keys = [layer.keys.clone() for layer in batch.layers()]
    mask = batch.mask.clone()
    batch.select([0, 4, 3, 1])
    for layer, before in zip(batch.layers(), keys, strict=True):
        assert torch.equal(layer.keys, before[[0, 4, 3, 1]])
    assert torch.equal(batch.mask, mask[[0, 4, 3, 1]])
    assert batch.positions.tolist() == [0, 40, 30, 10] and batch.unused() == 8
    late = _batch(rows=1)
    batch.join(late.cache, late.mask, late.positions, late.pending)
    assert batch.rows == 5 and batch.unused() == 0 and batch.held() == 5 * 5
