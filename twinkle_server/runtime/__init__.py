"""The runtime: the one layer between the fronts and the scheduler.

It owns tenants and ownership (`Core`), op construction (merge groups, token costs),
the store, the plain values passed between them (`runtime.values`: op and checkpoint
references, refusals, model and sampler entries), and the typed verbs every front calls:
`runtime.training` (create_model, forward, optim_step, save, load, ...),
`runtime.sampling` (sessions, sample, sampling without a session, compute_logprobs; each
request's rules checked once, before it is queued), `runtime.runs` (sessions, runs, checkpoints, capabilities) and
`runtime.external` (external weights and their signed download URLs); `runtime.lifetimes`
ends models and sampling sessions (unloads, closed sessions, expiries). Verbs
take plain values and an authenticated tenant (`Runtime.authenticate`) and return plain
values or raise the one error family (`twinkle_server.engine.errors`). Nothing here
imports a protocol: a front maps values and error categories to its own wire.
"""

from __future__ import annotations

from collections.abc import Sequence

from twinkle_server.config.flags import ServerConfig
from twinkle_server.config.model_table import ModelConfig
from twinkle_server.engine.protocol import EngineAPI
from twinkle_server.runtime.audit import Audit
from twinkle_server.runtime.copies import Copies
from twinkle_server.runtime.core import SUBMITTED, Core, bearer_token
from twinkle_server.runtime.external import External
from twinkle_server.runtime.imports import Imports
from twinkle_server.runtime.lifetimes import Lifetimes
from twinkle_server.runtime.runs import Runs
from twinkle_server.runtime.sampling import Sampling
from twinkle_server.runtime.stability import Stability
from twinkle_server.runtime.trace_exports import TraceExports
from twinkle_server.runtime.training import Training
from twinkle_server.runtime.values import (
    CheckpointRef,
    ModelEntry,
    OpRef,
    SamplerEntry,
    check_metadata,
    checkpoint_ref,
)
from twinkle_server.store import Store

__all__ = ["SUBMITTED", "CheckpointRef", "ModelEntry", "OpRef", "Runtime", "SamplerEntry", "bearer_token",
           "check_metadata", "checkpoint_ref"]


class Runtime(Core):
    """`Core` plus its verb groups."""

    def __init__(self, config: ServerConfig,
                 engines: EngineAPI | Sequence[tuple[ModelConfig, EngineAPI]],
                 store: Store) -> None:
        super().__init__(config, engines, store)
        self.lifetimes = Lifetimes(self)   # unloads, session ends, expiries
        self.training = Training(self, self.lifetimes)
        self.sampling = Sampling(self, self.lifetimes)
        self.runs = Runs(self, self.lifetimes)
        self.stability = Stability(self)   # stable_reinforce's records (sampling side)
        self.external = External(self)
        self.audit = Audit(self)           # the audit log (entries written by the verbs)
        self.copies = Copies(self)         # copy_weights
        self.imports = Imports(self)       # adapters in: uploads
        self.trace_exports = TraceExports(self)   # session traces out: signed downloads
        self.sweeps.append(self.imports.expire)
