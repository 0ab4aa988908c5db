"""The engine on several ranks: FSDP2 shards the frozen base, adapters are replicated.

Every rank holds one `Engine` with the same adapters. The frozen base is sharded with
FSDP2 (`fully_shard` per decoder layer, then a root unit holding the embeddings, the final
norm and the output layer), so each rank keeps about 1/N of its bytes at rest and
all-gathers one layer at a time during a pass. LoRA weights live outside the modules
FSDP manages (`MultiLoraLinear.adapters` is a plain dict), so they are ordinary tensors,
replicated on every rank, and adapters come and go at run time as on one rank.

A merged pass (`engine.forward`) runs as follows on each rank:

1. `share`: the rank takes a contiguous, token-balanced run of the pass's datums (a datum
   is never split: its attention needs all of it). A rank with no datum runs one token
   of padding instead, because every rank must take part in every layer's all-gather.
2. `run`: hidden states and target logprobs of its datums, inside one forward of the
   FSDP root (`_Root`), so the root's parameters are gathered for the whole pass,
   output layer and chunked logprobs included.
3. `gather_rows`: every rank receives every datum's logprobs; the rank's own stay
   attached to its graph. Each rank then computes every request's loss, metrics and
   counters exactly as one rank would, on the same numbers, so losses of any kind
   (sums, token means, sequence means) need no rule for combining partial results.
4. backward: gradients reach only the rank's own datums' share of each loss, so
   `all_reduce_grads` sums the pass's new gradients over the ranks (one all-reduce per
   bucket), and every rank ends the pass with the same gradients, hence the same
   optimizer steps.

The rank-0 process drives the others through `twinkle_server.ranks.replication`; this module
is torch only.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from twinkle_server.engine.base_model import BaseModel, load_base_model, resolve_dtype
from twinkle_server.engine.errors import InvalidArgument

GRAD_BUCKET_BYTES = 64 * 2**20
"""Largest all-reduce of adapter gradients: big enough to amortise each collective's
latency, small enough that the flat copy is a fraction of the adapters' state."""


def share_of(lengths: Sequence[int], rank: int, world: int) -> range:
    """Rank `rank`'s datums of a pass of datums with these token `lengths`: a contiguous,
    token-balanced run. Datum i goes to the rank whose equal slice of the pass's tokens
    holds its midpoint, so shares differ by about one datum's tokens at most; a rank gets
    none when the pass has fewer datums than ranks."""
    total = sum(lengths)
    start, mine = 0, []
    for index, n in enumerate(lengths):
        if min(world - 1, (2 * start + n) * world // (2 * total)) == rank:
            mine.append(index)
        start += n
    return range(mine[0], mine[-1] + 1) if mine else range(0)


class _Root(nn.Module):
    """The FSDP root: owns the base model so `fully_shard` manages its top-level weights,
    and runs any function as its forward so those weights are gathered around it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


@dataclass(frozen=True)
class Placement:
    """Where this process sits: `rank` of `world` ranks, and its device."""

    rank: int
    world: int
    local_rank: int
    device: torch.device


def placement_from_env(device: str = "auto") -> Placement:
    """This process's rank and device from torchrun's environment (`RANK`, `WORLD_SIZE`,
    `LOCAL_RANK`); `device` 'auto' picks `cuda:LOCAL_RANK` when CUDA is present."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type
    return Placement(rank, world, local, torch.device(kind, local) if kind == "cuda"
                     else torch.device(kind))


class Parallel:
    """One rank's share of a sharded engine: the process group, the device mesh, the
    FSDP root, and the collectives a pass needs. Build with `Parallel.init`; one process
    alone uses `OneRank`, where every collective is the identity, so the engine's code
    is the same on one rank and on several."""

    keeps_input_grads = True
    """The input embeddings' output requires grad (`shard`): every rank's backward must
    reach every layer, each of which gathers its weights again with the others."""

    def __init__(self, placement: Placement, mesh: Any, group: Any = None,
                 ranks: Sequence[int] | None = None) -> None:
        self.placement = placement
        self.mesh = mesh
        self.group = group
        """The process group of this engine's collectives (None: every rank's)."""
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(placement.world))
        """The job's ranks this engine is sharded over, its own rank `rank` among them."""
        self.root: _Root | None = None
        self.layers: list[nn.Module] = []

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def world(self) -> int:
        return self.placement.world

    @classmethod
    def init(cls, placement: Placement, timeout_s: float,
             shard_group_size: int = 0) -> Parallel:
        """Join the process group (nccl on CUDA, gloo on CPU; every collective bounded by
        `timeout_s`) and build the mesh: one shard group of all ranks, or with
        `shard_group_size` G, ranks sharded in groups of G and replicated across groups
        (hybrid sharding: shard within a node, replicate across nodes)."""
        from torch.distributed.device_mesh import init_device_mesh

        world = placement.world
        size = shard_group_size or world
        if size < 1 or world % size:
            raise InvalidArgument(f"--shard-group-size: {shard_group_size} does not divide "
                                  f"the {world} ranks")
        kind = placement.device.type
        if kind == "cuda":
            torch.cuda.set_device(placement.device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if kind == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=placement.device if kind == "cuda" else None)
        if size == world:
            mesh = init_device_mesh(kind, (world,), mesh_dim_names=("shard",))
        else:
            mesh = init_device_mesh(kind, (world // size, size),
                                    mesh_dim_names=("replicate", "shard"))
        return cls(placement, mesh)

    def subgroup(self, ranks: Sequence[int], backend: str | None = None) -> Parallel | None:
        """A `Parallel` over the job's `ranks` only (sorted, rank 0 among them), for one
        of several served models, with its own process group: None on a rank outside
        them. Every rank of the job calls this, in the same order, for every model."""
        from torch.distributed.device_mesh import DeviceMesh

        ranks = sorted(ranks)
        group = dist.new_group(ranks, backend=backend)
        me = dist.get_rank()
        if me not in ranks:
            return None
        kind = self.placement.device.type
        placement = replace(self.placement, rank=ranks.index(me), world=len(ranks))
        mesh = DeviceMesh.from_group(group, kind, mesh_dim_names=("shard",))
        return Parallel(placement, mesh, group, ranks)

    def close(self, clean: bool = True) -> None:
        """Leave the process group; `clean` (every rank is leaving too) first waits for
        the others, so no rank tears down its connections while another still uses them."""
        if dist.is_initialized():
            if clean:
                dist.barrier()
            dist.destroy_process_group()

    # ------------------------------------------------------------------ sharding

    def load_base(self, model: str, device: str, dtype: str, cache_dir: str | None
                  ) -> BaseModel:
        """The base model `model` for this rank (on its own device, whatever `device`
        says), to `shard`: loaded into host memory, then each decoder layer moves to the
        device as it is sharded, so the device never holds more than its shards and one
        layer."""
        target = self.placement.device
        base = load_base_model(model, device="cpu", dtype=str(resolve_dtype(dtype, target))
                               .removeprefix("torch."), cache_dir=cache_dir)
        base.device = target
        return base

    def shard(self, model: nn.Module) -> None:
        """Shard `model` (frozen, on this rank's device, LoRA layers injected): one FSDP
        unit per decoder layer, and the root unit for the rest."""
        from torch.distributed.fsdp import fully_shard

        layers = getattr(model.get_decoder(), "layers", None)
        if not layers:
            raise InvalidArgument("model: its decoder has no `layers` list to shard")
        for layer in layers:
            fully_shard(layer, mesh=self.mesh)
        self.layers = list(layers)
        self.root = _Root(model)
        fully_shard(self.root, mesh=self.mesh)
        # FSDP allocates each unit's all-gather buffers at its first gather and keeps them;
        # made under the sampler's inference mode they could never be written again
        # outside it. Gather every unit once now, in normal mode.
        for unit in (*layers, self.root):
            unit.unshard()
            unit.reshard()
        # Every rank's backward must reach every layer (each re-gathers its weights), even a
        # rank whose rows' adapters sit only in upper layers or the output layer: the
        # embeddings' output then requires grad in training passes.
        model.enable_input_require_grads()

    def run(self, fn: Callable[..., Any], *args: Any, backward: bool = False) -> Any:
        """`fn(*args)` with the base's weights available to it: one forward of the root.

        The root's weights are released after it, unless a `backward` pass will follow:
        then they stay until `end_pass` (the backward needs the output layer again)."""
        if self.root is None:
            raise RuntimeError("Parallel.run before shard")
        try:
            out = self.root(fn, *args)
        except BaseException:
            self._reset_units()
            raise
        if not backward:
            self.root.reshard()
        return out

    def anchor(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor | float:
        """A zero that depends on every output of a piece of a pass, added to the loss so
        this rank's backward runs through the whole piece even when no kept loss uses its
        rows: each layer's backward gathers its weights again, with every rank."""
        return torch.stack([out.sum() for out in outputs]).sum() * 0.0

    def end_pass(self) -> None:
        """After a training pass's backward (or instead of it, when every loss of the pass
        was dropped): release the root's weights and FSDP's per-pass state."""
        if self.root is not None:
            self._reset_units()

    def _reset_units(self) -> None:
        """Every FSDP unit resharded and idle, whatever the pass left behind (a backward
        that never ran because no loss was kept, or an exception mid-pass).

        torch >= 2.12 does it all in the root's `reset_iter_state`. Before it (torch 2.11,
        say) resharding is what is left to do: FSDP's own end-of-backward callback resets
        its per-pass state after a backward, and a forward that raised leaves only state
        the next forward overwrites. A backward that raised can leave that callback
        unqueued for good there, which costs nothing while serving: any failure on
        several ranks ends the group (`twinkle_server.ranks.replication`). The base is frozen,
        so no gradient reduction of FSDP's is ever pending."""
        if hasattr(self.root, "reset_iter_state"):
            self.root.reset_iter_state()
            return
        for unit in (*self.layers, self.root):
            unit.reshard()

    def local_param_bytes(self) -> int:
        """Bytes of the base's parameters this rank holds at rest (its shards)."""
        if self.root is None:
            return 0
        total = 0
        for param in self.root.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            total += local.numel() * local.element_size()
        return total

    def describe_share(self) -> str:
        """One log line: the base bytes this rank holds, of the whole."""
        return (f"rank {self.rank} of {self.world} holds {self.local_param_bytes()} of the "
                f"base's {self.base_param_bytes()} parameter bytes")

    def gathered_bytes(self) -> int:
        """Memory a training pass gathers beyond this rank's shards, at most at once: the
        root unit (embeddings, final norm, output layer), held for the whole pass, and two
        decoder layers (the one running and the one FSDP prefetches)."""
        def size(module: nn.Module) -> int:
            return sum(p.numel() * p.element_size() for p in module.parameters())

        layer_bytes = [size(layer) for layer in self.layers]
        root_bytes = self.base_param_bytes() - sum(layer_bytes)
        return root_bytes + 2 * max(layer_bytes, default=0)

    def base_param_bytes(self) -> int:
        """Bytes of the whole base's parameters (every rank's shards together)."""
        if self.root is None:
            return 0
        return sum(p.numel() * p.element_size() for p in self.root.parameters())

    # ------------------------------------------------------------------ a pass's rows

    def share(self, lengths: Sequence[int]) -> range:
        """This rank's datums of a pass (`share_of`)."""
        return share_of(lengths, self.rank, self.world)

    def gather_rows(self, local: Sequence[torch.Tensor], shapes: Sequence[torch.Size],
                    mine: range) -> list[torch.Tensor]:
        """Every datum's tensor (shape `shapes[i]`) from the rank that computed it.

        `local` holds this rank's datums' tensors (`mine`), which are returned as they are
        (still attached to the graph); the others arrive detached, as float32."""
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        lengths = [int(s[0]) for s in shapes]
        per_rank = [sum(sizes[i] for i in share_of(lengths, r, self.world))
                    for r in range(self.world)]
        width = max(per_rank)
        device = self.placement.device
        flat = torch.zeros(width, dtype=torch.float32, device=device)
        if local:
            mine_flat = torch.cat([t.detach().reshape(-1).float() for t in local])
            flat[:mine_flat.numel()] = mine_flat
        gathered = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(gathered, flat, group=self.group)
        rows: list[torch.Tensor] = []
        for rank in range(self.world):
            owned = share_of(lengths, rank, self.world)
            pieces = gathered[rank][:per_rank[rank]].split([sizes[i] for i in owned])
            for i, piece in zip(owned, pieces, strict=True):
                rows.append(local[i - mine.start] if rank == self.rank
                            else piece.reshape(shapes[i]))
        return rows

    # ------------------------------------------------------------------ adapter state

    def all_reduce_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Sum `params`' gradients over the ranks in buckets (a missing gradient counts as
        zeros and is created); every rank ends with the same sums."""
        grads = []
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in grads:
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= GRAD_BUCKET_BYTES:
                self._reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            self._reduce_bucket(bucket)

    def _reduce_bucket(self, bucket: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        for grad, piece in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
            grad.copy_(piece.view_as(grad))

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank (every rank gets the same answer)."""
        box = torch.tensor([int(flag)], dtype=torch.int64, device=self.placement.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.group)
        return bool(box)

    def gather_objects(self, local: list[Any]) -> list[Any]:
        """Every rank's `local` list (small results: sampled tokens), concatenated in rank
        order, on every rank."""
        found: list[Any] = [None] * self.world
        dist.all_gather_object(found, local, group=self.group)
        return [item for part in found for item in part]

    def min_int(self, value: int | None) -> int | None:
        """The smallest `value` over the ranks (None on any rank: None), so a decision
        that depends on each rank's free memory comes out the same everywhere."""
        box = torch.tensor([-1 if value is None else value], dtype=torch.int64,
                           device=self.placement.device)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.group)
        return None if int(box) < 0 else int(box)


class OneRank(Parallel):
    """The trivial `Parallel`: rank 0 of 1, the whole base on this process's device, and
    every collective the identity (a share is every datum, a gather or a reduction
    returns its input). The engine uses it when given no `Parallel`."""

    keeps_input_grads = False

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(Placement(0, 1, 0, torch.device(device)), mesh=None)

    def close(self, clean: bool = True) -> None:
        pass

    def load_base(self, model: str, device: str, dtype: str, cache_dir: str | None
                  ) -> BaseModel:
        base = load_base_model(model, device=device, dtype=dtype, cache_dir=cache_dir)
        self.placement = Placement(0, 1, 0, base.device)
        return base

    def shard(self, model: nn.Module) -> None:
        pass

    def run(self, fn: Callable[..., Any], *args: Any, backward: bool = False) -> Any:
        return fn(*args)

    def anchor(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor | float:
        return 0.0

    def share(self, lengths: Sequence[int]) -> range:
        return range(len(lengths))

    def gather_rows(self, local: Sequence[torch.Tensor], shapes: Sequence[torch.Size],
                    mine: range) -> list[torch.Tensor]:
        return list(local)

    def all_reduce_grads(self, params: Sequence[torch.Tensor]) -> None:
        pass

    def any_rank(self, flag: bool) -> bool:
        return flag

    def gather_objects(self, local: list[Any]) -> list[Any]:
        return local

    def min_int(self, value: int | None) -> int | None:
        return value
