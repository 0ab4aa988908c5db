"""An adapter trained elsewhere, checked against a base before it becomes a checkpoint.

An upload is a PEFT LoRA directory: `adapter_config.json` and `adapter_model.safetensors`.
Nothing in it is trusted: the weights are read as safetensors only (a format that holds
tensors and no code; never unpickled), every tensor must be the LoRA matrix of a linear
layer the engine trains, with that layer's shape at the declared rank, or of an MoE expert
projection its `target_parameters` name (PEFT's `ParamWrapper` layout, `engine.experts`),
and finite; the config may ask for nothing the engine does not compute (DoRA, per-layer
ranks, biases, extra trained modules, experts the engine does not compute, linears that
peft reads as a MoE's experts). What passes is written again in the engine's own checkpoint
format (`checkpoint.write_peft`), which every other path (sampling, loading to train,
export) already reads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from twinkle_server.engine import checks, experts
from twinkle_server.engine.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    peft_key,
    peft_renamed_leaves,
    rename_keys,
    write_peft,
)
from twinkle_server.engine.declared import DeclaredNames, declared_names
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.lora import ALL_LINEAR, Router
from twinkle_server.engine.roles import layer_roles
from twinkle_server.engine.types import LoraSpec

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
"""The files an import holds, and nothing else."""
MAX_CONFIG_BYTES = 1 << 20
UNSERVED_CONFIG: dict[str, Any] = {
    "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none",
    "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
    "fan_in_fan_out": False, "use_qalora": False, "lora_bias": False,
    "trainable_token_indices": None, "megatron_config": None, "layer_replication": None,
    "alora_invocation_tokens": None, "use_bdlora": None,
    "arrow_config": None, "kasa_config": None,
}
"""PEFT LoRA options the engine does not compute, each with the value that asks for
nothing (a missing key is that value)."""
SERVED_INIT = (True, False, "gaussian", "eva", "orthogonal", "mica")
"""`init_lora_weights` values that leave the base as it is (they only choose the
matrices' first values). The others (PiSSA, OLoRA, LoftQ, CorDA, LoRA-GA) rewrite the
base's weights when the adapter is made, so its matrices mean something only on that
rewritten base; peft's conversion of such an adapter to a plain one saves `true`. Their
own option tables (`corda_config`, ...) are left as peft saves them: the init says which
ran."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ImportedAdapter:
    """A checked upload: its LoRA shape, the linear modules it adapts, the expert
    parameters it adapts (full names), and its matrices as float32 under their PEFT
    keys."""

    spec: LoraSpec
    modules: tuple[str, ...]
    tensors: dict[str, torch.Tensor]
    roles: Mapping[str, str | None] = field(default_factory=dict)
    """Each adapted linear's role for Tinker's switches (`engine.roles`); the expert
    `parameters` are `train_mlp`'s."""
    parameters: tuple[str, ...] = ()

    def write(self, out: Path, base_model_path: str) -> None:
        """The engine's checkpoint files for it, into directory `out`."""
        write_peft(out, self.spec, self.tensors, list(self.modules), base_model_path,
                   target_parameters=list(self.parameters))


@dataclass(frozen=True)
class BaseLinears:
    """A base's linear layers as `(in_features, out_features)` by module name, the
    name of its output layer (which `'all-linear'` leaves out), each linear's role for
    Tinker's switches (`engine.roles`), its MoE experts modules (`engine.experts`; on the
    meta device), its `model_type`, and its names in its checkpoint's declared
    architecture (`engine.declared`). Names are the engine's."""

    shapes: dict[str, tuple[int, int]]
    output: str | None
    roles: Mapping[str, str | None] = field(default_factory=dict)
    experts: experts.ExpertsLayers = experts.ExpertsLayers({}, {})
    model_type: str | None = None
    names: DeclaredNames = DeclaredNames()


def base_linears(model_dir: Path) -> BaseLinears:
    """The linear layers of the base in `model_dir`: the model built from its config on
    the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    shapes = {name: (module.in_features, module.out_features)
              for name, module in model.named_modules() if type(module) is torch.nn.Linear}
    output = next((n for n, m in model.named_modules() if m is head), None)
    return BaseLinears(shapes, output, layer_roles(model, shapes, output or ""),
                       experts.inject(model, Router()), config.model_type,
                       declared_names(str(model_dir)))


def read_import(directory: Path, base: BaseLinears, max_rank: int,
                max_bytes: int) -> ImportedAdapter:
    """The adapter in `directory` (its `ADAPTER_FILES`; anything else there, such as the
    README.md `peft` writes beside them, is not part of it), checked against a base whose
    linear layers are `base`'s; raises `InvalidArgument` naming the file, the field and
    the limit.

    Module names may be the base checkpoint's declared architecture's (what peft on it
    saves, and the engine exports: `engine.declared`) or those of the class the engine
    loads; the adapter holds the engine's."""
    missing = [name for name in ADAPTER_FILES if not (directory / name).is_file()]
    if missing:
        raise InvalidArgument(f"files: an adapter is {list(ADAPTER_FILES)}; {missing} not "
                              "found")
    for name in ADAPTER_FILES:
        size = (directory / name).stat().st_size
        limit = MAX_CONFIG_BYTES if name == CONFIG_FILE else max_bytes
        if size > limit:
            raise InvalidArgument(f"{name}: {size} bytes, over the {limit}-byte limit")
    spec, targets, excluded = _config(directory / CONFIG_FILE, max_rank)
    spec = replace(spec, target_parameters=tuple(sorted(
        base.names.engine(p) for p in spec.target_parameters or ())))
    _not_converted(targets, base)
    weights = _weight_targets(spec, base)
    # Names and shapes first, from the file's header: a file of other tensors is refused
    # before any is read (their size is then bounded by the base's layers and the rank).
    shapes = rename_keys(_shapes(directory / WEIGHTS_FILE), base.names.engine)
    parameters = _expert_tensors(shapes, spec, base)
    modules = _modules({k: v for k, v in shapes.items() if k not in parameters},
                       base.shapes, spec.rank)
    if targets is not None or weights:
        _targeted(modules, targets, excluded, base, weights)
    return ImportedAdapter(spec, tuple(modules),
                           rename_keys(_weights(directory / WEIGHTS_FILE), base.names.engine),
                           {m: base.roles.get(m) for m in modules},
                           tuple(sorted(set(parameters.values()))))


def named_base(directory: Path) -> str:
    """The base the adapter in `directory` says it was trained on (its config's
    `base_model_name_or_path`), or "" where it names none or its config cannot be read
    (`read_import` then says why)."""
    path = directory / CONFIG_FILE
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return ""
        config = json.loads(path.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return ""
    named = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return named if isinstance(named, str) else ""


def _not_converted(targets: str | list[str] | None, base: BaseLinears) -> None:
    """Refuse `target_modules` that peft would read as this base's experts (and router)
    rather than as linears (`checkpoint.peft_renamed_leaves`): what it loads would not be
    what the file's names say."""
    converted = peft_renamed_leaves(base.model_type) if base.model_type else frozenset()
    if not converted or targets is None:
        return
    names = [targets] if isinstance(targets, str) else targets
    for name in names:
        if isinstance(targets, str) or name.rsplit(".", 1)[-1] in converted:
            raise InvalidArgument(
                f"{CONFIG_FILE}: target_modules {name!r} is read by peft on this MoE base "
                f"as its experts or router (transformers 4 names {sorted(converted)}), "
                "which the engine does not compute that way; list such linears in "
                "target_parameters by their weight (`<module>.weight`), as the engine's "
                "exports do, and the experts by their projections")


def _expert_tensors(shapes: Mapping[str, tuple[int, ...]], spec: LoraSpec,
                    base: BaseLinears) -> dict[str, str]:
    """The file's expert matrices (PEFT key -> the base parameter they adapt), exactly
    those `spec.target_parameters` selects on this base, each of its shape at the rank."""
    if not spec.target_parameters:
        return {}
    try:
        chosen = experts.targets(base.experts, spec)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{CONFIG_FILE}: {exc}") from None
    out = {}
    for target in chosen:
        layer = base.experts.served[target.layer]
        fan_in, fan_out = layer.features(target.projection)
        rows = layer.num_experts * spec.rank
        for which, shape in (("lora_A", (rows, fan_in)), ("lora_B", (fan_out, rows))):
            key = peft_key(target.peft_module, which)
            if shapes.get(key) != shape:
                found = list(shapes[key]) if key in shapes else "nothing"
                raise InvalidArgument(f"{WEIGHTS_FILE}: {key} has shape {found}; this base's "
                                      f"{target.parameter} at rank {spec.rank} needs "
                                      f"{list(shape)}")
            out[key] = target.parameter
    return out


def _weight_targets(spec: LoraSpec, base: BaseLinears) -> set[str]:
    """The linears whose weight the config's `target_parameters` names (`<module>.weight`,
    as `checkpoint.peft_targets` writes for MoE model types peft would otherwise rewrite;
    `experts.split_parameters`): LoRA on such a weight is LoRA on its linear. A weight of
    no linear is refused by name (expert projections: `_expert_tensors`)."""
    linears: set[str] = set()
    for module in experts.split_parameters(spec.target_parameters or ())[0]:
        hits = {n for n in base.shapes if n == module or n.endswith(f".{module}")}
        if not hits:
            raise InvalidArgument(f"{CONFIG_FILE}: target_parameters names "
                                  f"{module + '.weight'!r}, not the weight of a linear layer "
                                  "of this base; the engine computes LoRA on linear layers "
                                  "and expert projections")
        linears |= hits
    return linears


def _targeted(modules: list[str], targets: str | list[str] | None, excluded: Any,
              base: BaseLinears, weights: set[str]) -> None:
    """Every module the tensors adapt is one the config's `target_modules` selects (and
    `exclude_modules` leaves), by peft's own rules, or whose weight `target_parameters`
    names (`weights`): peft would leave the others' matrices out, and the adapter would
    mean something else. As peft, a pattern among several that matches nothing of this
    base is no error. A module is selected by its name in either tree (`base.names`)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    if targets is None:
        selected = set(weights)
    elif isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        selected = {n for n in base.shapes if n != base.output} | weights
    else:
        try:
            config = LoraConfig(target_modules=targets, exclude_modules=excluded)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"{CONFIG_FILE}: target_modules or exclude_modules: "
                                  f"{exc}") from None
        selected = {n for n in base.shapes if check_target_module_exists(config, n)
                    or check_target_module_exists(config, base.names.declared(n))} | weights
    if stray := [m for m in modules if m not in selected]:
        raise InvalidArgument(f"{CONFIG_FILE}: target_modules {targets!r} does not select "
                              f"{stray[0]!r}, which {WEIGHTS_FILE} adapts (peft would leave "
                              "its matrices out)")


def _config(path: Path, max_rank: int) -> tuple[LoraSpec, str | list[str] | None, Any]:
    """The config's LoRA shape, its `target_modules` when it names them, and its
    `exclude_modules`."""
    where = CONFIG_FILE
    try:
        config = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InvalidArgument(f"{where}: not JSON (or nested too deep)") from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"{where}: not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidArgument(f"{where}: peft_type {config.get('peft_type')!r}; only LORA "
                              "adapters are served")
    for key, neutral in UNSERVED_CONFIG.items():
        value = config.get(key, neutral)
        if not (value == neutral or value is None or value is False or value in ({}, [])):
            raise InvalidArgument(f"{where}: {key} is {value!r}; the engine does not "
                                  f"compute it (give {neutral!r})")
    init = config.get("init_lora_weights", True)
    if not any(init is served or init == served and type(init) is str
               for served in SERVED_INIT):
        raise InvalidArgument(f"{where}: init_lora_weights is {init!r}, which rewrites the "
                              f"base's weights (or is not peft's); the engine serves "
                              f"adapters made with {list(SERVED_INIT)}, or converted to "
                              "plain LoRA by peft")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if type(rank) is not int or not 1 <= rank <= max_rank:
        raise InvalidArgument(f"{where}: r is {rank!r}; give an integer in [1, {max_rank}] "
                              "(the server's max_rank)")
    if type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha <= 0:
        raise InvalidArgument(f"{where}: lora_alpha is {alpha!r}; give a number > 0")
    dropout = config.get("lora_dropout") or 0.0
    if type(dropout) not in (int, float) or not 0 <= dropout < 1:
        raise InvalidArgument(f"{where}: lora_dropout is {dropout!r}; give a number in [0, 1)")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise InvalidArgument(f"{where}: use_rslora is {rslora!r}; give true or false")
    parameters = config.get("target_parameters")
    if parameters is not None and not (isinstance(parameters, list)
                                       and all(isinstance(t, str) for t in parameters)):
        raise InvalidArgument(f"{where}: target_parameters is {parameters!r}; give a list of "
                              "expert parameter names")
    spec = LoraSpec(rank=rank, alpha=float(alpha), dropout=float(dropout), use_rslora=rslora,
                    target_parameters=tuple(sorted(parameters or ())))
    checks.lora_scaling(spec, f"{where}: lora_alpha")
    targets = config.get("target_modules")
    if targets is not None and not (isinstance(targets, str) or isinstance(targets, list)
                                    and all(isinstance(t, str) for t in targets)):
        raise InvalidArgument(f"{where}: target_modules is {targets!r}; give a list of "
                              "module names or a pattern")
    return spec, targets, config.get("exclude_modules")


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape by name, from the safetensors header alone."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            shapes = {key: tuple(handle.get_slice(key).get_shape())
                      for key in handle.keys()}   # noqa: SIM118 - safe_open has no __iter__
    except (SafetensorError, OSError, ValueError) as exc:
        raise InvalidArgument(f"{WEIGHTS_FILE}: not a safetensors file ({exc})") from None
    if not shapes:
        raise InvalidArgument(f"{WEIGHTS_FILE}: holds no tensors")
    return shapes


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors as float32, read as safetensors and nothing else."""
    from safetensors import SafetensorError, safe_open

    where = WEIGHTS_FILE
    out = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():   # noqa: SIM118 - safe_open has no __iter__
                tensor = handle.get_tensor(key)
                if tensor.dtype not in DTYPES:
                    raise InvalidArgument(f"{where}: {key} is {tensor.dtype}; give float32, "
                                          "bfloat16 or float16")
                tensor = tensor.to(torch.float32)
                if not bool(torch.isfinite(tensor).all()):
                    raise InvalidArgument(f"{where}: {key} holds values that are not finite")
                out[key] = tensor
    except (SafetensorError, OSError, ValueError) as exc:
        raise InvalidArgument(f"{where}: not a safetensors file ({exc})") from None
    if not out:
        raise InvalidArgument(f"{where}: holds no tensors")
    return out


def _modules(shapes: Mapping[str, tuple[int, ...]], linears: Mapping[str, tuple[int, int]],
             rank: int) -> list[str]:
    """The modules tensors of `shapes` adapt: each a linear layer of the base, with both
    its `lora_A` `[rank, in]` and `lora_B` `[out, rank]`."""
    where = WEIGHTS_FILE
    modules = set()
    for key in shapes:
        module, which = _split(key)
        if module is None:
            raise InvalidArgument(f"{where}: {key!r} is not a LoRA matrix "
                                  "(base_model.model.<module>.lora_A|lora_B.weight)")
        if module not in linears:
            raise InvalidArgument(f"{where}: {key!r} adapts {module!r}, which is not a linear "
                                  "layer of this base (another architecture?)")
        modules.add(module)
    for module in sorted(modules):
        fan_in, fan_out = linears[module]
        for which, shape in (("lora_A", (rank, fan_in)), ("lora_B", (fan_out, rank))):
            key = peft_key(module, which)
            if key not in shapes:
                raise InvalidArgument(f"{where}: has {module!r}'s other matrix but not {key!r}")
            if shapes[key] != shape:
                raise InvalidArgument(f"{where}: {key} has shape {list(shapes[key])}; "
                                      f"this base at rank {rank} needs {list(shape)}")
    return sorted(modules)


def _split(key: str) -> tuple[str | None, str | None]:
    prefix = "base_model.model."
    for which in ("lora_A", "lora_B"):
        suffix = f".{which}.weight"
        if key.startswith(prefix) and key.endswith(suffix):
            return key[len(prefix):-len(suffix)], which
    return None, None
