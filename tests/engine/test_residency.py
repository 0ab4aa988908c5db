"""Adapter residency (`engine.residency`): past `--max-adapters` resident adapters the
least recently used pages out and comes back, exactly, at its next use; what a pass or
the decode pool needs never pages out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import InvalidArgument, ResourceExhausted
from twinkle_server.engine.types import (
    AdamParams,
    EngineLimits,
    ForwardRequest,
    LoraSpec,
    LossSpec,
    SampleRequest,
    SamplingParams,
)

from ..numerics import LOGPROB_ATOL

CE = LossSpec("cross_entropy")
ADAPTERS = ("a", "b", "c")


def _engine(tiny_cache, slots: int) -> Engine:
    return Engine.load("tiny", cache_dir=str(tiny_cache),
                       limits=EngineLimits(max_adapters=slots, max_rank=64, max_seq_len=256,
                                           max_batch_tokens=4096))


def _state(engine: Engine, name: str) -> list[torch.Tensor]:
    """Every tensor the adapter's run has: weights and the optimizer's moments."""
    adapter = engine.adapters[name]
    out = [p.detach().clone() for p in adapter.parameters()]
    for param in adapter.parameters():
        out += [v.clone() for v in adapter.optimizer.state[param].values()]
    return out


def _round_robin(engine: Engine, datums, steps: int = 3) -> list[float]:
    """Three adapters trained in turn, one forward_backward and one optim_step each a
    step: with 2 slots every adapter pages in at each of its ops but the first."""
    for i, name in enumerate(ADAPTERS):
        engine.add_adapter(name, LoraSpec(rank=4, alpha=8, seed=i + 1))
    losses = []
    for _ in range(steps):
        for name in ADAPTERS:
            [out] = engine.forward_batch([ForwardRequest(name, datums, CE, True)])
            losses.append(out.loss)
            engine.optim_step(name, AdamParams(learning_rate=1e-2))
    return losses


def test_a_run_paged_out_and_in_between_its_steps_is_the_run_that_stayed_resident(
        tiny_cache, datums):
    """The same ops on 2 slots and on 8: losses, weights and Adam moments equal bit for
    bit (paging moves no number: the passes and steps are the same computations)."""
    paged, resident = _engine(tiny_cache, 2), _engine(tiny_cache, 8)
    assert _round_robin(paged, datums) == _round_robin(resident, datums)
    for name in ADAPTERS:
        for got, want in zip(_state(paged, name), _state(resident, name), strict=True):
            assert torch.equal(got, want)
    stats = paged.paging_stats()
    assert (stats.resident, stats.paged) == (2, 1) and stats.page_outs >= 6
    assert resident.paging_stats().page_outs == 0


def test_a_merged_pass_of_more_adapters_than_slots_runs_in_passes_that_fit(
        tiny_cache, datums):
    """Three adapters' requests in one batch on 2 slots: two passes, each request's
    loss what the one merged pass gives (another pass shape: LOGPROB_ATOL)."""
    paged, resident = _engine(tiny_cache, 2), _engine(tiny_cache, 8)
    for engine in (paged, resident):
        for i, name in enumerate(ADAPTERS):
            engine.add_adapter(name, LoraSpec(rank=4, alpha=8, seed=i + 1))
    batch = [ForwardRequest(name, datums, CE, False) for name in ADAPTERS]
    got, want = paged.forward_batch(batch), resident.forward_batch(batch)
    for g, w in zip(got, want, strict=True):
        assert g.loss == pytest.approx(w.loss, rel=1e-5)
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            np.testing.assert_allclose(a, b, atol=LOGPROB_ATOL, rtol=0)


def test_an_adapter_the_sampler_decodes_from_never_pages_out(tiny_cache):
    """On one slot, while adapter a's sample decodes in the pool, adding b would page a
    out: it is refused, naming --max-adapters, and a's sample finishes; then b goes in."""
    engine = _engine(tiny_cache, 1)
    engine.add_adapter("a", LoraSpec(rank=4, alpha=8, seed=1))
    request = SampleRequest("a", None, np.asarray([5, 6, 7], np.int64), 1,
                            SamplingParams(max_tokens=40, seed=1, ignore_eos=True))
    done = dict(engine.decode([request], ["sample"], 0.0))
    assert not done                                   # still decoding
    with pytest.raises(ResourceExhausted, match="--max-adapters"):
        engine.add_adapter("b", LoraSpec(rank=4, alpha=8, seed=2))
    while "sample" not in done:
        done.update(engine.decode([], [], 0.0))
    assert len(done["sample"].sequences[0].tokens) == 40
    engine.add_adapter("b", LoraSpec(rank=4, alpha=8, seed=2))
    assert list(engine.resident) == ["b"] and engine.paging_stats().paged == 1


def test_past_the_host_budget_paged_adapters_go_to_disk_and_come_back_exactly(
        tiny_cache, datums, tmp_path):
    """One slot and no host budget: every adapter paged out is written to the page dir
    and its tensors freed, and the run still equals the resident one bit for bit. A
    stale page file of an earlier process is cleared when the engine starts."""
    from twinkle_server.engine.residency import Spill

    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "0-stale.pt").write_bytes(b"from a crashed process")
    spilled = Engine.load("tiny", cache_dir=str(tiny_cache),
                          limits=EngineLimits(max_adapters=1, max_rank=64, max_seq_len=256,
                                              max_batch_tokens=4096),
                          spill=Spill(pages, host_bytes=0))
    assert list(pages.iterdir()) == []
    resident = _engine(tiny_cache, 8)
    assert _round_robin(spilled, datums) == _round_robin(resident, datums)
    stats = spilled.paging_stats()
    assert (stats.resident, stats.paged, stats.on_disk) == (1, 0, 2)
    assert len(list(pages.iterdir())) == 2
    assert all(p.numel() == 0 for name in ("a", "b") for p in spilled.adapters[name]
               .parameters())                                # freed while on disk
    for name in ADAPTERS:
        spilled._adapter(name)                               # paged back in to be read
        for got, want in zip(_state(spilled, name), _state(resident, name), strict=True):
            assert torch.equal(got, want)
    spilled.remove_adapter("c")
    spilled.remove_adapter("a")
    assert len(list(pages.iterdir())) == 1                   # removed: no page kept


def test_a_tenant_cycling_through_many_runs_pages_out_its_own_not_the_others(
        tiny_cache, datums):
    """Four slots; alice's two runs sit idle while bob trains six runs in turn: bob's
    page-ins take bob's slots (he would hold the most), so alice's runs stay resident
    throughout. Alice's third run would give her three of four: it pages out her own
    least recently used, not one of bob's two."""
    engine = _engine(tiny_cache, 4)
    for name in ("a1", "a2"):
        engine.add_adapter(name, LoraSpec(rank=4, alpha=8, seed=1), owner="alice")
    bobs = [f"b{i}" for i in range(6)]
    for i, name in enumerate(bobs):
        engine.add_adapter(name, LoraSpec(rank=4, alpha=8, seed=i + 2), owner="bob")
        assert {"a1", "a2"} <= set(engine.resident)
    for _ in range(2):
        for name in bobs:
            engine.forward_batch([ForwardRequest(name, datums, CE, True)])
            engine.optim_step(name, AdamParams(learning_rate=1e-2))
            assert {"a1", "a2"} <= set(engine.resident)
    engine.add_adapter("a3", LoraSpec(rank=4, alpha=8, seed=9), owner="alice")
    assert sorted(name[0] for name in engine.resident) == ["a", "a", "b", "b"]
    assert "a1" not in engine.resident and "a3" in engine.resident


def test_with_one_tenant_the_least_recently_used_pages_out(tiny_cache):
    engine = _engine(tiny_cache, 2)
    for i, name in enumerate(("x", "y", "z")):
        engine.add_adapter(name, LoraSpec(rank=4, alpha=8, seed=i + 1), owner="carol")
    assert list(engine.resident) == ["y", "z"]
    engine._adapter("y")
    engine._adapter("x")
    assert list(engine.resident) == ["y", "x"]


def test_a_request_refused_by_its_checks_pages_nothing_in(tiny_cache, datums):
    """On one slot with b resident, a's request whose loss the datums cannot serve is
    refused by name, and a stays paged out: checking a request reads no adapter tensor."""
    engine = _engine(tiny_cache, 1)
    for i, name in enumerate("ab"):
        engine.add_adapter(name, LoraSpec(rank=4, alpha=8, seed=i + 1))
    before = engine.paging_stats().page_ins
    [out] = engine.forward_batch([ForwardRequest("a", datums, LossSpec("importance_sampling"),
                                                 True)])
    assert isinstance(out, InvalidArgument) and "logprobs" in str(out)
    assert engine.paging_stats().page_ins == before and list(engine.resident) == ["b"]
