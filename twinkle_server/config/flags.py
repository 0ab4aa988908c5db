"""Server configuration: one typed object; its field descriptions produce `--help`.

Every field can also come from an environment variable `TWINKLE_<FIELD>` (upper case);
a command-line flag wins over the environment, which wins over the default. A numeric
field's range (`least`, `most`, `above` in its metadata) and a field's `choices` hold
for both, checked before anything loads (`ServerConfig.problem`, `from_args`).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from twinkle_server.config.model_table import ModelConfig, read_models_file, shorthand
from twinkle_server.engine.errors import InvalidArgument


def _opt(default, help: str, **extra):
    """A field: `help` for `--help`; `choices`; for a number its range, `least` and
    `most` (inclusive) or `above` (exclusive), and always finite."""
    return field(default=default, metadata={"help": help, **extra})


def flag(name: str) -> str:
    """The command-line flag of field `name`."""
    return "--" + name.replace("_", "-")


def _range_problem(name: str, value: float, meta: dict) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"{flag(name)}: {value} must be a finite number"
    if "least" in meta and value < meta["least"]:
        return f"{flag(name)}: {value} must be at least {meta['least']}"
    if "most" in meta and value > meta["most"]:
        return f"{flag(name)}: {value} must be at most {meta['most']}"
    if "above" in meta and not value > meta["above"]:
        return f"{flag(name)}: {value} must be above {meta['above']}"
    return None


@dataclass(frozen=True)
class ServerConfig:
    model: str = _opt("", "base model: 'tiny' or 'tiny-large' (built offline), a local HF "
                          "directory, or a hub id (downloaded into the Hugging Face cache "
                          "at start unless it is there or --offline is on); empty: tiny, "
                          "or the models of --models")
    models: Path | None = _opt(None, "TOML file with one [[models]] table per served base "
                                     "model (name, path, aliases, role, device, memory_gib, "
                                     "ranks and the limit flags' names); instead of --model")
    model_alias: tuple[str, ...] = _opt((), "extra name this base model answers to "
                                            "(repeatable), e.g. Qwen/Qwen3-4B", repeat=True)
    offline: str = _opt("off", "on: never download a model (as HF_HUB_OFFLINE=1): a hub id "
                               "must already be in the Hugging Face cache",
                        choices=("on", "off"))
    host: str = _opt("127.0.0.1", "address to bind; non-loopback needs API keys")
    port: int = _opt(0, "port; 0 picks a free one (printed as 'listening on HOST:PORT')",
                     least=0, most=65_535)
    http_port: int = _opt(-1, "HTTP port for the Tinker REST API (the stock tinker SDK), "
                              "/metrics and /api/v1/healthz; 0 picks a free one (printed as "
                              "'http listening on HOST:PORT'), -1 turns it off",
                          least=-1, most=65_535)
    data_dir: Path = _opt(Path("./twinkle-data"), "SQLite store and checkpoint files")
    scheduling: str = _opt("merged", "merged: one base pass for many tenants; timeshare: one "
                                     "model per pass (the baseline)", choices=("merged", "timeshare"))
    packing: str = _opt("on", "on: a merged pass packs its datums into one sequence, attention "
                              "confined to each (no padding); off: pads every datum to the "
                              "longest (the baseline)", choices=("on", "off"))
    activation_checkpointing: str = _opt(
        "auto", "on: training passes recompute each decoder layer in backward instead of "
                "keeping its activations (less memory, about one more forward of "
                "compute); auto: on an accelerator only when, without it, one datum of "
                "--max-seq-len would not fit a pass in half the memory free once the "
                "base is loaded (at 4096: Qwen3-8B and larger on one 141 GB device, 4B "
                "and larger on 80 GB), off on CPU",
        choices=("auto", "on", "off"))
    device: str = _opt("auto", "cpu, cuda, cuda:N or auto (on several ranks: each rank's "
                               "own cuda:LOCAL_RANK, or cpu)")
    dtype: str = _opt("auto", "float32, bfloat16 or auto (float32 on CPU, bf16 on CUDA)")
    max_adapters: int = _opt(32, "adapters loaded at once (all tenants)", least=1)
    max_adapters_per_tenant: int = _opt(8, "adapters one tenant may have loaded at once",
                                        least=1)
    adapter_host_memory_gib: float = _opt(
        0.0, "GiB of host memory adapters paged out past --max-adapters may hold; past it "
             "those paged out longest go to files in the data dir (freed from memory) until "
             "their next op. 0: no bound, they stay in host memory", least=0)
    max_sessions_per_tenant: int = _opt(64, "open sessions one tenant may hold", least=1)
    max_rank: int = _opt(128, "largest LoRA rank", least=1)
    max_seq_len: int = _opt(0, "longest sequence in tokens; 0 picks the model's "
                               "max_position_embeddings, at most --max-batch-tokens and "
                               "what memory allows: 16,384 on CPU, on an accelerator the "
                               "longest datum whose pass fits in half the memory free "
                               "after the base loads (with activation checkpointing unless "
                               "it is off); the value is logged. Above "
                               "max_position_embeddings is refused, and on a longrope "
                               "model (Phi-3.5, Phi-4-mini) above its "
                               "original_max_position_embeddings, which 0 picks", least=0)
    max_batch_tokens: int = _opt(262_144, "most tokens in one forward/forward_backward "
                                          "request", least=1)
    max_pass_tokens: int = _opt(0, "most tokens the base runs at once: a larger pass (one big "
                                   "request, or merged ones) runs in pieces of this many, "
                                   "same results for one more forward; it bounds a pass's "
                                   "memory, which adapter creation keeps free. At least "
                                   "--max-seq-len; 0 picks by device: 16,384 on CPU, on an "
                                   "accelerator the most whose activations fit in half the "
                                   "memory free after the base loads", least=0)
    merge_token_budget: int = _opt(0, "most tokens in one merged base-model pass; 0 picks "
                                      "by device: 1024 on CPU, 8192 on an accelerator",
                                  least=0)
    sampler: str = _opt("continuous", "continuous: sample requests join and leave one running "
                                      "decode batch between steps, a group's prompt is "
                                      "prefilled once, a session's extended prompts reuse "
                                      "its cached prefix; static: each batch of requests "
                                      "decodes to completion (the baseline)",
                        choices=("continuous", "static"))
    batch_invariant: str = _opt("off", "on: every sampling forward computes each row as it "
                                       "would alone, so a seeded request gives the same "
                                       "tokens and logprobs, bit for bit, beside any other "
                                       "requests, at any slice, with or without a prefix-"
                                       "cache hit (slower: BENCHMARKS.md); off: rows share "
                                       "the batch's kernels and may differ in the last bits",
                                choices=("on", "off"))
    max_queued_ops_per_tenant: int = _opt(
        1024, "ops one tenant may have waiting on one served model (queued, "
                            "or sampling in its decode pool): past it a new op is refused "
                            "at once (RESOURCE_EXHAUSTED; HTTP 429, which the SDK retries), "
                            "but never the op its model runs next", least=1)
    max_queued_bytes_per_tenant: int = _opt(
        1 << 30, "bytes of datums and prompts one tenant's waiting ops may "
                              "hold on one served model (an op alone always may wait)",
        least=1)
    max_queued_ops: int = _opt(4096, "ops all tenants together may have waiting on one "
                                     "served model", least=1)
    max_queued_bytes: int = _opt(4 << 30, "bytes of datums and prompts all tenants' "
                                          "waiting ops may hold on one served model",
                                 least=1)
    decode_slice_ms: float = _opt(100.0, "milliseconds of decoding between training passes "
                                         "while both wait: about what a training op waits "
                                         "behind sampling", above=0)
    kv_pool_tokens: int = _opt(0, "KV-cache positions the sampler holds (rows x width of its "
                                  "decode batch, shared prompt copies and cached prefixes); "
                                  "requests wait for room, one that can never fit is "
                                  "refused. 0 picks a quarter of the memory free after the "
                                  "base loads, at most 1,048,576", least=0)
    session_timeout: float = _opt(300.0, "seconds without a heartbeat or an op before a "
                                         "session's adapters are unloaded (checkpoints "
                                         "stay); the stock tinker SDK beats every 10 s, so "
                                         "under that its idle clients expire", above=0)
    max_stability_records: int = _opt(
        50_000, "sampled sequences one tenant keeps recorded for stable_reinforce "
                "(record_stability_info): past it a new record evicts the tenant's least "
                "recently used one (records also expire a day after their last use)",
        least=1)
    tls_cert: Path | None = _opt(None, "PEM certificate: serve TLS")
    tls_key: Path | None = _opt(None, "PEM private key for --tls-cert")
    log_level: str = _opt("info", "how much the server logs",
                          choices=("debug", "info", "warning", "error"))
    nproc_per_node: int = _opt(1, "ranks on this node: over 1 launches them through torch's "
                                  "elastic launcher (torchrun), the base sharded over them "
                                  "with FSDP2; rank 0 serves, the others follow it",
                            least=1)
    nnodes: str = _opt("1", "nodes (torchrun --nnodes: N or MIN:MAX); over 1 needs "
                            "--rdzv-endpoint")
    node_rank: int = _opt(0, "this node's rank among the nodes (torchrun --node-rank)",
                          least=0)
    rdzv_endpoint: str = _opt("", "HOST:PORT where the nodes meet (torchrun --rdzv-endpoint); "
                                  "empty: a single node")
    shard_group_size: int = _opt(0, "ranks that shard the base together; the groups "
                                    "replicate it (hybrid sharding: e.g. ranks per node). "
                                    "0: all ranks shard one copy", least=0)
    sampler_ranks: int = _opt(0, "under torchrun, the last K ranks sample apart from the "
                                 "others, which train (FSDP2); each holds a whole copy of "
                                 "the base and its own decode pool, and trained adapter "
                                 "weights reach it in memory. 0: every rank trains and "
                                 "samples", least=0)
    collective_timeout: float = _opt(600.0, "seconds any collective between ranks may take "
                                            "before the server gives the group up as lost "
                                            "(answers UNAVAILABLE, exits non-zero)",
                                      above=0)

    def problem(self) -> str | None:
        """The first flag whose value is out of its range, naming it and the limit, or
        None; on any number of ranks."""
        for f in fields(self):
            if f.type in ("int", "float"):
                if (problem := _range_problem(f.name, getattr(self, f.name),
                                              f.metadata)) is not None:
                    return problem
        if self.port and self.http_port == self.port:
            return (f"--http-port: {self.http_port} is --port's too; give another, or 0 "
                    "for a free one")
        return None

    def model_configs(self) -> list[ModelConfig]:
        """The served models: `--models`'s tables, or `--model` alone; the limit flags
        are each model's defaults. Raises `InvalidArgument` naming what cannot work."""
        defaults = {name: getattr(self, name) for name in MODEL_DEFAULTS}
        if self.models is None:
            return [shorthand(defaults, self.model, self.model_alias)]
        if self.model or self.model_alias:
            raise InvalidArgument("--model, --model-alias, --models: give --model (one model) "
                                  "or --models FILE (its tables name every model), not both")
        return read_models_file(self.models, defaults, {
            f.name: f.metadata["least"] for f in fields(self)
            if f.name in MODEL_DEFAULTS and "least" in f.metadata})


MODEL_DEFAULTS = ("device", "dtype", "max_adapters", "max_rank", "max_seq_len",
                  "max_batch_tokens", "max_pass_tokens", "kv_pool_tokens", "sampler_ranks")
"""The flags a `[[models]]` table may set for its own model."""


def _kind(f):
    return {"int": int, "float": float}.get(f.type, str)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field, help text from the field. A flag not given is None here:
    `from_args` reads its TWINKLE_* env var, or the default, so that an env value that
    cannot work is refused only by the command that reads it, naming the variable."""
    for f in fields(ServerConfig):
        default = f.default if f.default is not MISSING else None
        shown = "" if default in (None, ()) else f"; default {default}"
        kwargs = {"help": f"{f.metadata['help']} (env TWINKLE_{f.name.upper()}{shown})",
                  "dest": f.name, "default": None}
        if f.metadata.get("repeat"):
            kwargs["action"] = "append"
        else:
            kwargs.update(type=_kind(f), choices=f.metadata.get("choices"))
        parser.add_argument(flag(f.name), **kwargs)


def _from_env(f) -> object:
    """Field `f`'s value from its TWINKLE_* env var, or its default; raises
    `InvalidArgument` naming the variable for a value its flag would refuse."""
    name = f"TWINKLE_{f.name.upper()}"
    raw = os.environ.get(name)
    if raw is None:
        return f.default
    if f.metadata.get("repeat"):
        return [v for v in raw.split(",") if v]
    kind, choices = _kind(f), f.metadata.get("choices")
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or (choices and value not in choices):
        wanted = (f"one of {', '.join(choices)}" if choices
                  else "an integer" if kind is int else "a number")
        raise InvalidArgument(f"{name}={raw!r}: give {wanted} (as {flag(f.name)})")
    return value


def from_args(args: argparse.Namespace) -> ServerConfig:
    """The configuration: each flag given, else its env var, else its default. Raises
    `InvalidArgument` naming an env var whose value its flag would refuse."""
    values = {}
    for f in fields(ServerConfig):
        value = getattr(args, f.name)
        if value is None:
            value = _from_env(f)
        if f.name == "model_alias":
            value = tuple(value)
        elif f.name in ("data_dir", "models", "tls_cert", "tls_key") and value is not None:
            value = Path(value)
        values[f.name] = value
    return ServerConfig(**values)
