"""Stability records in the store: owned by tenant, expire a day after their last use
(each use restarts the day), bounded per tenant by evicting the least recently used, and
kept across a restart (a new `Store` on the same directory)."""

from __future__ import annotations

import numpy as np

from twinkle_server.store import StabilityRecord, Store

DAY = 24 * 3600.0


def _record(sequence_id: str, tenant: str = "alice", at: float = 1000.0) -> StabilityRecord:
    return StabilityRecord(sequence_id, tenant, "sess-1", np.array([5, 6, 7], np.int32),
                           np.array([9, 10], np.int32), np.array([-0.5, -1.25], np.float32),
                           at, at)


def test_records_round_trip_and_survive_a_restart(tmp_path):
    store = Store(tmp_path)
    store.add_stability_records([_record("a"), _record("b")], 10, DAY, now=1000.0)
    store.close()
    store = Store(tmp_path)
    found = store.stability_records("alice", ["a", "b", "c"], DAY, now=1001.0)
    assert sorted(found) == ["a", "b"]
    a = found["a"]
    assert (a.tenant, a.session_id) == ("alice", "sess-1")
    np.testing.assert_array_equal(a.prompt, [5, 6, 7])
    np.testing.assert_array_equal(a.tokens, [9, 10])
    np.testing.assert_array_equal(a.logprobs, np.array([-0.5, -1.25], np.float32))
    store.close()


def test_another_tenants_records_are_not_found(tmp_path):
    store = Store(tmp_path)
    store.add_stability_records([_record("a")], 10, DAY, now=1000.0)
    assert store.stability_records("bob", ["a"], DAY, now=1001.0) == {}
    store.close()


def test_a_record_expires_a_day_after_its_last_use_and_a_use_restarts_the_day(tmp_path):
    store = Store(tmp_path)
    store.add_stability_records([_record("a"), _record("b")], 10, DAY, now=1000.0)
    store.touch_stability_records("alice", ["a"], now=1000.0 + DAY - 1)
    found = store.stability_records("alice", ["a", "b"], DAY, now=1000.0 + DAY + 1)
    assert sorted(found) == ["a"]   # b was last used a day and a second ago
    # The next write sweeps the expired record out of the table.
    store.add_stability_records([_record("c", at=1000.0 + DAY + 1)], 10, DAY,
                                now=1000.0 + DAY + 1)
    assert store.count_stability_records("alice") == 2
    store.close()


def test_past_the_bound_the_least_recently_used_record_of_that_tenant_goes(tmp_path):
    store = Store(tmp_path)
    store.add_stability_records([_record("a", at=1.0), _record("b", at=2.0)], 2, DAY, now=3.0)
    store.add_stability_records([_record("x", "bob", at=3.0)], 2, DAY, now=3.0)
    store.touch_stability_records("alice", ["a"], now=4.0)      # b is now the oldest
    store.add_stability_records([_record("c", at=5.0)], 2, DAY, now=5.0)
    assert sorted(store.stability_records("alice", ["a", "b", "c"], DAY, now=6.0)) == ["a", "c"]
    assert list(store.stability_records("bob", ["x"], DAY, now=6.0)) == ["x"]
    store.close()
