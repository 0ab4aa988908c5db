"""Module names as the base checkpoint's declared architecture spells them.

A multimodal checkpoint may be loaded by `AutoModelForCausalLM` as its text-only class:
a real Qwen3.5 checkpoint declares `Qwen3_5ForConditionalGeneration` (`config.json`
`architectures`; text weights under `model.language_model.`), and transformers loads it
as `Qwen3_5ForCausalLM` (`model.layers.`), which the engine trains. peft places an adapter
by module name and does not translate between the two trees: an adapter named in one
tree, loaded on the other, wraps only what both share (`lm_head`) or nothing, silently,
or raises. Exports are loaded on the declared architecture (vLLM serves it too), so
checkpoints name the declared tree's modules (`checkpoint.write_peft`) and are read back
into the engine's (`checkpoint.read_weights`, `adapter_import.read_import`).

The map is two prefix swaps found on the meta device: the engine's decoder
(`get_decoder`) and output layer for the declared model's, checked parameter by
parameter (every parameter of the engine's model is one of the declared model's, of the
same shape). Where the engine loads the declared class itself (gemma3's
`Gemma3ForConditionalGeneration`, every text-only model) it is empty.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeclaredNames:
    """`prefixes`: `(engine's module path, the declared architecture's)` pairs, empty
    where the two trees are the same. A name under neither prefix is the same in both."""

    prefixes: tuple[tuple[str, str], ...] = ()

    def declared(self, name: str) -> str:
        """`name` (a module or parameter of the engine's model) in the declared tree."""
        return _swap(name, self.prefixes)

    def engine(self, name: str) -> str:
        """`name` (of the declared tree) in the engine's model."""
        return _swap(name, tuple((b, a) for a, b in self.prefixes))

    def to_json(self) -> str:
        return json.dumps([list(pair) for pair in self.prefixes])

    @classmethod
    def from_json(cls, text: str) -> DeclaredNames:
        return cls(tuple((str(a), str(b)) for a, b in json.loads(text)))


def _swap(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    """`name` with the longest matching whole-component prefix `a` replaced by `b`."""
    for a, b in sorted(pairs, key=lambda pair: -len(pair[0])):
        if name == a or name.startswith(a + "."):
            return b + name[len(a):]
    return name


@functools.lru_cache(maxsize=16)
def declared_names(model_dir: str) -> DeclaredNames:
    """The map for the base in `model_dir` (built on the meta device, no weights read;
    cached per directory). Empty where the declared architecture is not a transformers
    class, is the class the engine loads, or its tree cannot be matched parameter by
    parameter (logged: exports then name the engine's tree, which peft loads on the class
    AutoModelForCausalLM gives)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError):
        return DeclaredNames()
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        return DeclaredNames()
    try:
        with torch.device("meta"):
            loaded = AutoModelForCausalLM.from_config(config)
            declared = None if type(loaded) is cls else cls(config)
    except (TypeError, ValueError, AttributeError, KeyError, RuntimeError) as exc:
        log.warning("%s: could not build %s on the meta device (%s); adapter exports name "
                    "the modules of the class AutoModelForCausalLM loads", model_dir, arch,
                    exc)
        return DeclaredNames()
    if declared is None:
        return DeclaredNames()
    names = _match(loaded, declared)
    if names is None:
        log.warning("%s: the modules of %s do not map onto its declared architecture %s; "
                    "adapter exports name %s's modules", model_dir, type(loaded).__name__,
                    arch, type(loaded).__name__)
        return DeclaredNames()
    return names


def _match(loaded: torch.nn.Module, declared: torch.nn.Module) -> DeclaredNames | None:
    """The prefix pairs taking `loaded`'s decoder and output layer to `declared`'s, if
    they take every parameter of `loaded` to one of `declared` of the same shape."""
    pairs = []
    for ours, theirs in ((loaded.get_decoder(), declared.get_decoder()),
                         (loaded.get_output_embeddings(), declared.get_output_embeddings())):
        a, b = _path(loaded, ours), _path(declared, theirs)
        if not a or not b:
            return None
        if a != b:
            pairs.append((a, b))
    names = DeclaredNames(tuple(pairs))
    shapes = {n: p.shape for n, p in declared.named_parameters(remove_duplicate=False)}
    for name, param in loaded.named_parameters(remove_duplicate=False):
        if shapes.get(names.declared(name)) != param.shape:
            return None
    return names


def _path(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    if module is None:
        return None
    return next((n for n, m in model.named_modules() if m is module), None)
