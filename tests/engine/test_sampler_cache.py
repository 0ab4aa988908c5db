"""The sampler checkpoint cache: keyed by the files' bytes, hashed only when they change."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from twinkle_server.engine import checkpoint, sampler_cache
from twinkle_server.engine.sampler_cache import SamplerCache, sampler_key
from twinkle_server.engine.types import AdamParams, ForwardRequest, LoraSpec, LossSpec

CE = LossSpec("cross_entropy")


def _trained_checkpoint(engine, add, datums, name: str, seed: int, path: Path) -> None:
    """A sampler checkpoint of an adapter trained one step (a new adapter's B is 0, so
    every new adapter scores like the base)."""
    add(name, LoraSpec(rank=4, alpha=8, seed=seed))
    engine.forward_batch([ForwardRequest(name, datums[:3], CE, True)])
    engine.optim_step(name, AdamParams(learning_rate=1e-2))
    engine.save_weights(name, path)


def _counting(monkeypatch, owner, name: str) -> list[int]:
    """Count the calls of `owner.name` (still calling it)."""
    calls = [0]
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)
    return calls


def test_weights_rewritten_with_the_same_size_and_mtime_are_loaded_afresh(
        engine, add, datums, tmp_path):
    tokens = np.asarray(datums[1].input_ids)
    _trained_checkpoint(engine, add, datums, "same_old", 11, tmp_path / "old")
    _trained_checkpoint(engine, add, datums, "same_new", 12, tmp_path / "new")
    weights = tmp_path / "old" / checkpoint.WEIGHTS_FILE
    before = engine.compute_logprobs(None, str(tmp_path / "old"), tokens)
    # Exact here and below: one sequence each, the same shapes and code (a sampler
    # checkpoint is a frozen adapter of the same layers, its float32 weights copied in).
    np.testing.assert_array_equal(before, engine.compute_logprobs("same_old", None, tokens))
    key = sampler_key(tmp_path / "old")
    assert engine.has_sampler(tmp_path / "old")

    # Other bytes of the same size written in place (same inode), the mtime put back.
    new_bytes = (tmp_path / "new" / checkpoint.WEIGHTS_FILE).read_bytes()
    old = os.stat(weights)
    assert len(new_bytes) == old.st_size and new_bytes != weights.read_bytes()
    with open(weights, "r+b") as handle:
        handle.write(new_bytes)
    os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns))
    now = os.stat(weights)
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (old.st_ino, old.st_size,
                                                          old.st_mtime_ns)

    after = engine.compute_logprobs(None, str(tmp_path / "old"), tokens)
    np.testing.assert_array_equal(after, engine.compute_logprobs("same_new", None, tokens))
    assert not np.allclose(before[1:], after[1:])
    assert sampler_key(tmp_path / "old") != key and engine.has_sampler(tmp_path / "old")


def test_an_unchanged_checkpoint_keeps_its_key_and_is_neither_reloaded_nor_rehashed(
        engine, add, datums, tmp_path, monkeypatch):
    _trained_checkpoint(engine, add, datums, "unchanged", 13, tmp_path / "sampler")
    path = str(tmp_path / "sampler")
    # The clock stands just after the save, then moves past the racy window.
    clock = [os.stat(Path(path) / checkpoint.WEIGHTS_FILE).st_ctime_ns + 1]
    monkeypatch.setattr(sampler_cache, "_clock_ns", lambda: clock[0])
    hashes = _counting(monkeypatch, sampler_cache, "_hash_files")
    reads = _counting(monkeypatch, checkpoint, "read_weights")
    tokens = np.asarray(datums[0].input_ids)
    scored = engine.compute_logprobs(None, path, tokens)
    first = sampler_key(path)
    assert (hashes[0], reads[0]) == (1, 1) and engine.has_sampler(path)
    for _ in range(3):
        np.testing.assert_array_equal(engine.compute_logprobs(None, path, tokens), scored)
        assert sampler_key(path) == first and engine.has_sampler(path)
    assert (hashes[0], reads[0]) == (1, 1)
    # Past the window the just-saved files are hashed once more, then never again.
    clock[0] += sampler_cache._RACY_WINDOW_NS
    for _ in range(3):
        engine.compute_logprobs(None, path, tokens)
        assert sampler_key(path) == first
    assert (hashes[0], reads[0]) == (2, 1)
    assert os.path.realpath(path) in engine.sampler_dirs()


def test_a_same_tick_rewrite_that_keeps_the_signature_is_seen_once_the_racy_window_passes(
        tmp_path, monkeypatch):
    # Coarse file timestamps (no multigrain ctime) leave such a rewrite's stat unchanged.
    (tmp_path / checkpoint.CONFIG_FILE).write_text("{}")
    weights = tmp_path / checkpoint.WEIGHTS_FILE
    weights.write_bytes(b"a" * 64)
    signature = sampler_cache._signature(str(tmp_path))
    monkeypatch.setattr(sampler_cache, "_signature", lambda path: signature)
    clock = [signature[-1][4] + 1]
    monkeypatch.setattr(sampler_cache, "_clock_ns", lambda: clock[0])
    first = sampler_key(tmp_path)
    weights.write_bytes(b"b" * 64)
    assert sampler_key(tmp_path) == first  # within the window: trusted provisionally
    clock[0] += sampler_cache._RACY_WINDOW_NS
    second = sampler_key(tmp_path)
    assert second != first
    hashes = _counting(monkeypatch, sampler_cache, "_hash_files")
    assert sampler_key(tmp_path) == second and hashes[0] == 0  # settled: not hashed again


def test_the_key_changes_with_the_bytes_and_returns_with_them(tmp_path):
    (tmp_path / checkpoint.CONFIG_FILE).write_text("{}")
    weights = tmp_path / checkpoint.WEIGHTS_FILE
    weights.write_bytes(b"a" * 64)
    first = sampler_key(tmp_path)
    weights.write_bytes(b"b" * 64)
    second = sampler_key(tmp_path)
    weights.write_bytes(b"a" * 64)
    assert first != second and sampler_key(tmp_path) == first
    assert first.startswith(f"sampler:{os.path.realpath(tmp_path)}@")
    (tmp_path / checkpoint.CONFIG_FILE).write_text('{"r": 8}')  # the config counts too
    assert sampler_key(tmp_path) != first
    assert sampler_key(tmp_path / "absent").endswith("@missing")


def test_a_checkpoint_rewritten_while_it_loads_is_loaded_again_under_its_new_key(tmp_path):
    (tmp_path / checkpoint.CONFIG_FILE).write_text("{}")
    weights = tmp_path / checkpoint.WEIGHTS_FILE
    weights.write_bytes(b"a" * 64)
    loads: list[tuple[str, bytes]] = []
    detached: list[str] = []

    def load(key: str, path: str) -> str:
        if not loads:  # a save lands while the first load reads
            weights.write_bytes(b"b" * 64)
        loads.append((key, weights.read_bytes()))
        return key

    cache = SamplerCache(load, lambda key, adapter: detached.append(key))
    key = cache.route(str(tmp_path))
    assert key == sampler_key(tmp_path) and detached == [loads[0][0]]
    assert loads[-1] == (key, b"b" * 64)  # the cached load holds the bytes its key names


def test_dirs_names_the_real_directories_of_the_loaded_checkpoints(tmp_path):
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / checkpoint.CONFIG_FILE).write_text("{}")
        (tmp_path / name / checkpoint.WEIGHTS_FILE).write_bytes(name.encode())
    (tmp_path / "link").symlink_to(tmp_path / "one")
    detached: list[str] = []
    cache = SamplerCache(lambda key, path: key, lambda key, adapter: detached.append(key),
                         size=1)
    assert cache.route(str(tmp_path / "link")) == cache.route(str(tmp_path / "one"))
    cache.route(str(tmp_path / "two"))
    assert cache.dirs() == {os.path.realpath(tmp_path / d) for d in ("one", "two")}
    cache.trim()
    assert cache.dirs() == {os.path.realpath(tmp_path / "two")} and len(detached) == 1
    assert str(tmp_path / "one") not in cache and str(tmp_path / "two") in cache
