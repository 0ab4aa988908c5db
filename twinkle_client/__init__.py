"""Twinkle's native client: `init_twinkle_client(...)` and `MultiLoraTransformersModel`.

    from twinkle_client import init_twinkle_client, get_logger
    from twinkle_client.model import MultiLoraTransformersModel

`import twinkle_client` stays light: torch and transformers are imported only when a model,
template or tensor needs them, and the model class is loaded on first use.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from twinkle_client.client import TwinkleClient, init_twinkle_client

if TYPE_CHECKING:
    from twinkle_client.model import MultiLoraTransformersModel

__all__ = ["MultiLoraTransformersModel", "TwinkleClient", "get_logger", "init_twinkle_client"]

LOG_FORMAT = "[%(asctime)s %(levelname)s %(name)s] %(message)s"
_LAZY = {"MultiLoraTransformersModel": "twinkle_client.model"}


def get_logger(name: str = "twinkle_client", level: int = logging.INFO) -> logging.Logger:
    """A logger under the `twinkle_client` namespace that prints to stderr.

    The namespace's root gets one stream handler (timestamp, level, name) the first time,
    so `logger.info(...)` in a user script shows without any logging setup; an application
    that configures logging itself can remove it or set `propagate`.
    """
    root = logging.getLogger("twinkle_client")
    if not any(getattr(h, "_twinkle", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT, "%H:%M:%S"))
        handler._twinkle = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False
    if root.level == logging.NOTSET or root.level > level:
        root.setLevel(level)
    full = name if name == "twinkle_client" or name.startswith("twinkle_client.") \
        else f"twinkle_client.{name}"
    return logging.getLogger(full)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'twinkle_client' has no attribute {name!r}")
