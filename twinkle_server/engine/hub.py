"""Models by hub id: a served model named `org/name` that is not a built-in, a local
directory or already in the Hugging Face cache is downloaded into that cache
(`huggingface_hub`, which draws its progress bars on stderr) before the server loads it,
as vLLM and transformers do. `HF_ENDPOINT`, `HF_HOME`, `HF_HUB_CACHE` and `HF_TOKEN` mean
what they mean to `huggingface_hub`; `--offline on` or `HF_HUB_OFFLINE=1` keeps the server
from the network, and a model not in the cache is then refused by name.

What is fetched: the repository's configs, tokenizer files, chat template and safetensors
weights (`FILES`); other weight formats (`.bin`, `.pt`, GGUF, ONNX) are not, and a
repository without safetensors is refused, since the loader reads safetensors only.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from twinkle_server.engine.errors import InvalidArgument, NotFound
from twinkle_server.engine.tiny_model import RECIPES

log = logging.getLogger(__name__)

FILES = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja")
"""What a model's download fetches: configs (and the safetensors index), weights,
tokenizer files (sentencepiece, tiktoken, BPE merges) and chat templates."""


def offline(flag: bool = False) -> bool:
    """Whether downloads are off: `--offline on`, or `HF_HUB_OFFLINE` set true."""
    return flag or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true",
                                                                             "yes", "on")


def is_local(model: str) -> bool:
    """A built-in or a local directory: nothing to download."""
    return model in RECIPES or Path(model).expanduser().is_dir()


def cached(model: str) -> Path | None:
    """`model`'s snapshot in the local cache, or None."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, local_files_only=True, allow_patterns=FILES))
    except Exception:
        return None


def fetch(model: str, no_network: bool = False) -> Path | None:
    """Make `model` loadable from the cache: download it when it is a hub id not yet there.
    Returns where its files are (None for a built-in or a local directory).

    Raises:
        NotFound: a path that is no directory; not cached and downloads are off; or
            the hub has no such model.
        InvalidArgument: the download holds no safetensors weights.
    """
    if is_local(model):
        return None
    if model.startswith(("/", "./", "../", "~")):   # a path, never a hub id
        raise NotFound(f"model: no model directory at {model!r}")
    if (path := cached(model)) is not None:
        return path
    if offline(no_network):
        raise NotFound(
            f"model: {model!r} is neither a built-in ('tiny', 'tiny-large'), a local model "
            "directory, nor in the local Hugging Face cache, and downloads are off "
            "(--offline on or HF_HUB_OFFLINE)")
    from huggingface_hub import constants, snapshot_download

    log.info("downloading %s from %s into %s", model, constants.ENDPOINT,
             constants.HF_HUB_CACHE)
    try:
        path = Path(snapshot_download(model, allow_patterns=FILES))
    except Exception as exc:
        raise NotFound(f"model: {model!r} could not be downloaded from "
                       f"{constants.ENDPOINT}: {type(exc).__name__}: {exc}") from None
    if not any(path.glob("*.safetensors")):
        raise InvalidArgument(f"model: {model!r} has no safetensors weights (the server loads "
                              "no other format); convert it, or serve a local directory")
    log.info("downloaded %s to %s", model, path)
    return path
