"""What adapter residency costs (`engine.residency`): one page-out and page-in of a rank-32
adapter (all linears, AdamW state) on the tiny and the wide base, and an RL-shaped step
(one forward_backward of 4 x 128 tokens and one optim_step a run, runs in turn) with 4x
more live runs than resident slots against all of them resident, on the same engine
shapes, rounds interleaved. On a CPU the adapter's tensors stay in place (host memory is
the device's), so a page is its detach and attach; on an accelerator it also copies the
adapter's weights, gradients and Adam moments over the bus, which the last line puts on
paper for an 8B model at rank 32 over PCIe Gen5.

Run: `.venv/bin/python -m bench.residency`. Figures measure and print; nothing passes or
fails on time.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench.data import random_datums
from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.residency import Spill
from twinkle_server.engine.types import AdamParams, EngineLimits, LoraSpec, LossSpec

SPEC = LoraSpec.from_tinker(rank=32, seed=0)
SLOTS, RUNS, ROUNDS = 2, 8, 3
PCIE_GEN5_BYTES_S = 64e9
"""PCIe Gen5 x16, one direction, before protocol overhead."""
QWEN3_8B_RANK32_PARAMS = 36 * 32 * (2 * 4096 + 4096 + 1024 * 2 + 4096 * 2 + 3 * (4096 + 12288))
"""LoRA parameters of Qwen3-8B (36 layers, hidden 4096, 8 KV heads of 128, MLP 12288) at
rank 32 on every linear of its layers: r x (in + out) for q, k, v, o, gate, up, down."""


def _engine(path: str, slots: int, spill: Spill | None = None) -> Engine:
    return Engine.load(path, device="cpu", limits=EngineLimits(max_adapters=slots),
                       spill=spill)


def page_seconds(path: str, spill: Spill | None = None, rounds: int = 20
                 ) -> tuple[float, float, int]:
    """Median seconds of one page-out and one page-in (to disk and back with `spill`),
    and the adapter's state bytes."""
    engine = _engine(path, 1, spill)
    engine.add_adapter("one", SPEC)
    engine.forward_batch([ForwardRequest("one", random_datums(2, 32, engine.base.vocab_size),
                                         LossSpec("cross_entropy"), True)])
    engine.optim_step("one", AdamParams(learning_rate=1e-3))
    outs, ins = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        engine._page_out("one")
        outs.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine._make_resident("one")
        ins.append(time.perf_counter() - start)
    return statistics.median(outs), statistics.median(ins), engine.adapter_info("one")[
        "state_bytes"]


def rl_steps(path: str) -> tuple[float, float]:
    """Seconds of one round (every run's step) with `SLOTS` resident slots and with all
    `RUNS` resident, the medians of interleaved rounds."""
    engines = {"paged": _engine(path, SLOTS), "resident": _engine(path, RUNS)}
    datums = random_datums(4, 128, engines["paged"].base.vocab_size)
    for engine in engines.values():
        for run in range(RUNS):
            engine.add_adapter(f"run{run}", LoraSpec.from_tinker(rank=32, seed=run))
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(ROUNDS + 1):
        for name, engine in engines.items():
            start = time.perf_counter()
            for run in range(RUNS):
                engine.forward_batch([ForwardRequest(f"run{run}", datums,
                                                     LossSpec("cross_entropy"), True)])
                engine.optim_step(f"run{run}", AdamParams(learning_rate=1e-3))
            seconds[name].append(time.perf_counter() - start)
    return tuple(statistics.median(s[1:]) for s in seconds.values())   # type: ignore[return-value]


def main() -> None:
    from bench.engine import _wider_base

    print(f"adapter residency (rank 32, all linears, AdamW; {SLOTS} slots for {RUNS} runs)")
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in (("tiny", "tiny"), ("wide", _wider_base(f"{tmp}/wide"))):
            out, back, nbytes = page_seconds(path)
            print(f"  {name}: page-out {out * 1e6:.0f} us, page-in {back * 1e6:.0f} us "
                  f"({nbytes / 2**20:.1f} MiB of adapter state, which stays in place on "
                  "a CPU)")
            out, back, _ = page_seconds(path, Spill(Path(tmp) / f"pages-{name}", 0))
            print(f"  {name}: to disk and back (--adapter-host-memory-gib past): page-out "
                  f"{out * 1e3:.1f} ms, page-in {back * 1e3:.1f} ms")
            paged, resident = rl_steps(path)
            print(f"  {name}: a round of {RUNS} runs' steps (forward_backward 4 x 128 + "
                  f"optim_step each) {paged:.3f} s on {SLOTS} slots against {resident:.3f} s "
                  f"all resident: {paged / resident:.2f}x")
    nbytes = QWEN3_8B_RANK32_PARAMS * 4 * 4
    print(f"  on paper, Qwen3-8B at rank 32: {QWEN3_8B_RANK32_PARAMS / 1e6:.0f} M LoRA "
          f"parameters, {nbytes / 2**20:.0f} MiB with gradients and Adam moments in float32: "
          f"{nbytes / PCIE_GEN5_BYTES_S * 1e3:.1f} ms each way over PCIe Gen5 x16 "
          f"({PCIE_GEN5_BYTES_S / 1e9:.0f} GB/s)")


if __name__ == "__main__":
    main()
