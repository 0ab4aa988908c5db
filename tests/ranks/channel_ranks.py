"""Run by tests/ranks/test_channel.py on two ranks (`python -m torch.distributed.run
--nproc-per-node 2 -m tests.ranks.channel_ranks`): rank 0 sends calls over the job's
channel, rank 1 answers over a channel of the two; rank 0 prints one JSON line of what
came back."""

from __future__ import annotations

import json
import os

import numpy as np
import torch.distributed as dist

from twinkle_server.ranks.channel import Channel

CALL = ("forward", {"tokens": np.arange(7, dtype=np.int64),
                    "weights": np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3),
                    "mask": np.array([True, False, True]),
                    "empty": np.zeros((0, 4), np.float16),
                    "strided": np.arange(12, dtype=np.int32)[::3],
                    "nested": [np.array([1.5]), "text", 3]})


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and np.array_equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    job = Channel.open(60.0)
    pair = Channel.subgroup((0, 1), 60.0)
    assert pair is not None
    if rank == 0:
        job.send(CALL)
        job.send(("no arrays", 1))
        answer = pair.receive(src=1)
        agreed = job.agree({"step": 3})
        print(json.dumps({"answer": answer, "agreed": agreed}), flush=True)
    else:
        received = [job.receive(), job.receive()]
        pair.send((_same(received[0], CALL), received[1] == ("no arrays", 1),
                   received[0][1]["weights"].flags.writeable), src=1)
        job.agree(None)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
