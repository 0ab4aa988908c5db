"""Tokenizers for the clients: from a local model directory, or fetched from the server.

Neither client ever reaches a model hub: a model id that is not a local directory names a
model the server serves, and its tokenizer files come over the connection (the
`GetTokenizer` RPC), once per process. The connection is the one given, else the default
(`init_twinkle_client`, `init_tinker_client(base_url=...)`), else one made for the download
from `TWINKLE_BASE_URL`/`TINKER_BASE_URL` (and `TWINKLE_API_KEY`/`TINKER_API_KEY`), so a
dataset can be encoded before any client object exists, as Tinker scripts do.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinkle_client import api
from twinkle_client.connection import Connection, env_endpoint, get_default_connection

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CLIENT_NAME = "twinkle_client.tokenizer"
"""Names the connection opened from the environment (it opens no session)."""
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
    model's tokenizer, fetched once per server and model.

    Args:
        model_id: a local model directory, or a served model name (`ms://`/`hf://`
            prefixes are dropped: `'ms://Qwen/Qwen3-0.6B'` asks for `'Qwen/Qwen3-0.6B'`).
        connection: the server to ask; default the default connection
            (`init_twinkle_client(...)` or `init_tinker_client(base_url=...)`), else a
            connection to `TWINKLE_BASE_URL` (then `TINKER_BASE_URL`) with `TWINKLE_API_KEY`
            (then `TINKER_API_KEY`), closed after the download and not made the default.

    Raises:
        ValueError: `model_id` is no local directory and there is no server to ask (no
            connection and neither base URL variable set).
        NotFoundError/InvalidArgumentError (client exceptions): the server does not serve it.

    Example:
        >>> tokenizer = load_tokenizer('ms://tiny')  # with TWINKLE_BASE_URL exported
    """
    from transformers import AutoTokenizer

    if not model_id:
        raise ValueError("model_id: empty; pass a served model name or a local directory")
    local = Path(model_id).expanduser()
    if local.is_dir():
        return AutoTokenizer.from_pretrained(local)
    connection = connection or get_default_connection()
    opened = None
    if connection is None:
        url, api_key = env_endpoint()
        if not url:
            raise ValueError(f"model_id: {model_id!r} is not a local directory and no Twinkle "
                             "server is connected; export TWINKLE_BASE_URL (or "
                             "TINKER_BASE_URL), call init_twinkle_client(...) or "
                             "init_tinker_client(base_url=...) first, or pass a model "
                             "directory")
        connection = opened = Connection(url, api_key, client_name=CLIENT_NAME,
                                         open_session=False)
    name = served_name(model_id)
    key = (connection.target, name)
    try:
        with _lock:
            if key not in _fetched:
                dest = Path(tempfile.mkdtemp(prefix="tokenizer-", dir=_scratch_dir()))
                api.download_tokenizer(connection, name, dest / "files")
                _fetched[key] = AutoTokenizer.from_pretrained(dest / "files")
            return _fetched[key]
    finally:
        if opened is not None:
            opened.close()


def _scratch_dir() -> Path:
    global _scratch
    if _scratch is None:
        _scratch = Path(tempfile.mkdtemp(prefix="twinkle-client-"))
        atexit.register(shutil.rmtree, _scratch, True)
    return _scratch
