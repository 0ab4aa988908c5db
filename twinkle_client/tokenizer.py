"""Tokenizers for the clients: from a local model directory, or fetched from the server.

Neither client ever reaches a model hub: a model id that is not a local directory names a
model the server serves, and its tokenizer files come over the connection (the
`GetTokenizer` RPC), once per process.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinkle_client.connection import Connection, get_default_connection

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HUB_SCHEMES = ("ms://", "hf://")
"""Prefixes of ModelScope/Hugging Face ids in user code; the server is asked for the rest."""

_fetched: dict[tuple[str, str], Any] = {}
_lock = threading.Lock()
_scratch: Path | None = None


def served_name(model_id: str) -> str:
    """The name to ask the server for: `model_id` without an `ms://` or `hf://` prefix."""
    for scheme in HUB_SCHEMES:
        if model_id.startswith(scheme):
            return model_id[len(scheme):]
    return model_id


def load_tokenizer(model_id: str, connection: Connection | None = None
                   ) -> PreTrainedTokenizerBase:
    """The tokenizer of `model_id`: `AutoTokenizer` on a local directory, else the served
    model's tokenizer from `connection` (default: the one `init_twinkle_client` made).

    Raises:
        ValueError: `model_id` is no local directory and there is no connection.
        NotFoundError/InvalidArgumentError (client exceptions): the server does not serve it.
    """
    from transformers import AutoTokenizer

    if not model_id:
        raise ValueError("model_id: empty; pass a served model name or a local directory")
    local = Path(model_id).expanduser()
    if local.is_dir():
        return AutoTokenizer.from_pretrained(local)
    connection = connection or get_default_connection()
    if connection is None:
        raise ValueError(f"model_id: {model_id!r} is not a local directory and no Twinkle "
                         "server is connected; call init_twinkle_client(...) first or pass "
                         "a model directory")
    name = served_name(model_id)
    key = (connection.target, name)
    with _lock:
        if key not in _fetched:
            dest = Path(tempfile.mkdtemp(prefix="tokenizer-", dir=_scratch_dir()))
            connection.download_tokenizer(name, dest / "files")
            _fetched[key] = AutoTokenizer.from_pretrained(dest / "files")
        return _fetched[key]


def _scratch_dir() -> Path:
    global _scratch
    if _scratch is None:
        _scratch = Path(tempfile.mkdtemp(prefix="twinkle-client-"))
        atexit.register(shutil.rmtree, _scratch, True)
    return _scratch
