"""Calls between the ranks of a job: rank 0 sends each call (an engine call to every rank
of a model, a sampler rank's work, a weight publication) over a gloo group as a small
pickled header, with the numpy arrays inside it (token ids, loss inputs, weights) taken
out and broadcast as one byte tensor: the arrays are never pickled. Every collective is
bounded by its group's timeout. `replication`, `sampler_rank` and `sampler_links` talk
through it."""

from __future__ import annotations

import datetime
import io
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


class _Pickler(pickle.Pickler):
    """Pickles a call, keeping numpy arrays out of the stream (sent as one tensor)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays: list[np.ndarray] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and not obj.dtype.hasobject and obj.dtype.names is None:
            self.arrays.append(np.ascontiguousarray(obj))
            return ("array", len(self.arrays) - 1, obj.dtype.str, obj.shape)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, blob: np.ndarray, offsets: list[int]) -> None:
        super().__init__(file)
        self.blob, self.offsets = blob, offsets

    def persistent_load(self, pid: Any) -> Any:
        _, index, dtype, shape = pid
        start, end = self.offsets[index], self.offsets[index + 1]
        return self.blob[start:end].view(np.dtype(dtype)).reshape(shape).copy()


class Channel:
    """Rank 0 -> every rank: engine calls, over the control group (gloo, CPU tensors);
    on a channel of two ranks, answers come back the same way (`src`)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    @classmethod
    def open(cls, timeout_s: float) -> Channel:
        """The channel over the default group (gloo), or a gloo group beside nccl with the
        same bound on each collective; every rank calls this at the same point."""
        if dist.get_backend() == "gloo":
            return cls(None)
        return cls(dist.new_group(backend="gloo",
                                  timeout=datetime.timedelta(seconds=timeout_s)))

    @classmethod
    def subgroup(cls, ranks: Sequence[int], timeout_s: float) -> Channel | None:
        """A channel to the job's `ranks` only (rank 0 among them), over a gloo group of
        its own: None on a rank outside them. Every rank calls this at the same point."""
        group = dist.new_group(sorted(ranks), backend="gloo",
                               timeout=datetime.timedelta(seconds=timeout_s))
        return cls(group) if dist.get_rank() in ranks else None

    def agree(self, value: Any) -> Any:
        """Rank 0's `value` (small and picklable), on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def send(self, call: tuple, src: int = 0) -> None:
        """`call` from this rank (the job's rank `src`) to the channel's others."""
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        pickler.dump(call)
        offsets = np.cumsum([0] + [a.nbytes for a in pickler.arrays]).tolist()
        header = [(buffer.getvalue(), offsets)]
        dist.broadcast_object_list(header, src=src, group=self.group)
        if offsets[-1]:
            blob = torch.from_numpy(np.concatenate(
                [a.reshape(-1).view(np.uint8) for a in pickler.arrays]))
            dist.broadcast(blob, src=src, group=self.group)

    def receive(self, src: int = 0) -> tuple:
        """What the job's rank `src` sends next."""
        header: list[Any] = [None]
        dist.broadcast_object_list(header, src=src, group=self.group)
        stream, offsets = header[0]
        blob = np.empty(0, np.uint8)
        if offsets[-1]:
            tensor = torch.empty(offsets[-1], dtype=torch.uint8)
            dist.broadcast(tensor, src=src, group=self.group)
            blob = tensor.numpy()
        return _Unpickler(io.BytesIO(stream), blob, offsets).load()
