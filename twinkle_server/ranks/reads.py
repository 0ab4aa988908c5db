"""The calls that rank 0's engine answers alone, for an engine over several ranks.

`ReplicatedEngine` (`replication`) and `SplitEngine` (`split`) both hold an engine on
rank 0 (`local`) that every rank-0-only read and save goes to unchanged: the base, the
limits, the adapters and their info, the request checks, and a training-state save.
`RankZeroReads` is that part of both; the calls each sends elsewhere are its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.base_model import BaseModel
from twinkle_server.engine.protocol import EngineAPI
from twinkle_server.engine.residency import PagingStats
from twinkle_server.engine.types import EngineLimits, ForwardRequest, LoraSpec, LossSpec


class RankZeroReads:
    """Reads, request checks and state saves answered by `local`, rank 0's engine."""

    def __init__(self, local: EngineAPI) -> None:
        self.local = local

    @property
    def base(self) -> BaseModel:
        return self.local.base

    @property
    def limits(self) -> EngineLimits:
        return self.local.limits

    @property
    def adapters(self) -> Mapping[str, Adapter]:
        return self.local.adapters

    def paging_stats(self) -> PagingStats:
        return self.local.paging_stats()

    def estimate_adapter_bytes(self, spec: LoraSpec) -> int:
        return self.local.estimate_adapter_bytes(spec)

    def adapter_info(self, adapter_id: str) -> dict[str, Any]:
        return self.local.adapter_info(adapter_id)

    def check_forward(self, request: ForwardRequest) -> None:
        self.local.check_forward(request)

    def validate_forward(self, request: ForwardRequest) -> LossSpec:
        return self.local.validate_forward(request)

    def get_train_configs(self, adapter_id: str) -> dict[str, Any]:
        return self.local.get_train_configs(adapter_id)

    def save_state(self, adapter_id: str, path: str | Path, include_optimizer: bool = True,
                   overwrite: bool = False) -> int:
        return self.local.save_state(adapter_id, path, include_optimizer, overwrite)

    def read_checkpoint_spec(self, path: str | Path) -> LoraSpec:
        return self.local.read_checkpoint_spec(path)
