"""`init_tinker_client()`: make `tinker.ServiceClient` (and the other clients) Twinkle's.

Existing Tinker code then runs unchanged against a Twinkle server:

    from tinker_compat import init_tinker_client
    init_tinker_client()
    from tinker import ServiceClient          # now tinker_compat.ServiceClient
    service_client = ServiceClient(base_url="http://127.0.0.1:8000")

Only the attributes of the `tinker` module are replaced; `tinker.types` and the exception
classes stay tinker's own (Twinkle's errors subclass them). Without this call the real SDK
is untouched: importing `tinker_compat` patches nothing.

Code that encodes a dataset before it creates a ServiceClient (the seed article's Tinker
example) needs the server for the tokenizer: exporting `TWINKLE_BASE_URL` is enough, or
`init_tinker_client(base_url=..., api_key=...)` names it.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import tinker

from tinker_compat.rest_client import RestClient, open_connection
from tinker_compat.sampling_client import SamplingClient
from tinker_compat.service_client import CLIENT_NAME, ServiceClient
from tinker_compat.training_client import TrainingClient
from twinkle_client.connection import (
    Connection,
    get_default_connection,
    set_default_connection,
)

PATCHED = {"ServiceClient": ServiceClient, "RestClient": RestClient,
           "TrainingClient": TrainingClient, "SamplingClient": SamplingClient}
"""The `tinker` module attributes `init_tinker_client` replaces."""

_made: Connection | None = None
"""The default connection the last `init_tinker_client(base_url=...)` made (closed when a
later call replaces it; one `init_twinkle_client` made belongs to its TwinkleClient)."""
_made_lock = threading.Lock()


def init_tinker_client(*, base_url: str | None = None, api_key: str | None = None,
                       **kwargs: Any) -> None:
    """Point `tinker.ServiceClient`, `tinker.RestClient`, `tinker.TrainingClient` and
    `tinker.SamplingClient` at the Twinkle implementations. Call it before
    `from tinker import ServiceClient`; calling it again is harmless.

    Args:
        base_url: optional; also make this server the default connection, which code
            that runs before any ServiceClient uses (templates fetching a tokenizer:
            `dataset.set_template('Template', model_id=...)`). Without it nothing is
            connected, and such code connects to `TWINKLE_BASE_URL` (then
            `TINKER_BASE_URL`) when it needs to. ServiceClients still take their own
            `base_url` (or the variables).
        api_key: the key for that default connection; default `TWINKLE_API_KEY`, then
            `TINKER_API_KEY`. Given alone, the URL comes from those variables.
        **kwargs: other options of the peer project's `init_tinker_client` do not apply;
            ignored with a FutureWarning, as ServiceClient ignores unknown ones.

    Raises:
        ValueError: `api_key` given but no base URL anywhere, or a malformed `base_url`.

    Example:
        init_tinker_client(base_url="http://127.0.0.1:8000")
        dataset.set_template("Template", model_id="ms://tiny")   # tokenizer from the server
        import tinker
        client = tinker.ServiceClient(base_url="http://127.0.0.1:8000")
    """
    if kwargs:
        warnings.warn(f"init_tinker_client ignores unsupported arguments: "
                      f"{', '.join(sorted(kwargs))}.", FutureWarning, stacklevel=2)
    for name, cls in PATCHED.items():
        setattr(tinker, name, cls)
    if base_url or api_key:
        _set_default(open_connection(base_url, api_key, CLIENT_NAME, open_session=False))


def _set_default(connection: Connection) -> None:
    """Make `connection` the default, closing the one an earlier call made (no session:
    closing only closes its channel)."""
    global _made
    with _made_lock:
        previous, _made = _made, connection
        set_default_connection(connection)
    if previous is not None and previous is not get_default_connection():
        previous.close()
