"""`init_tinker_client()`: make `tinker.ServiceClient` (and the other clients) Twinkle's.

Existing Tinker code then runs unchanged against a Twinkle server:

    from tinker_compat import init_tinker_client
    init_tinker_client()
    from tinker import ServiceClient          # now tinker_compat.ServiceClient
    service_client = ServiceClient(base_url="http://127.0.0.1:8000")

Only the attributes of the `tinker` module are replaced; `tinker.types` and the exception
classes stay tinker's own (Twinkle's errors subclass them). Without this call the real SDK
is untouched: importing `tinker_compat` patches nothing.
"""

from __future__ import annotations

import tinker

from tinker_compat.rest_client import RestClient
from tinker_compat.sampling_client import SamplingClient
from tinker_compat.service_client import ServiceClient
from tinker_compat.training_client import TrainingClient

PATCHED = {"ServiceClient": ServiceClient, "RestClient": RestClient,
           "TrainingClient": TrainingClient, "SamplingClient": SamplingClient}
"""The `tinker` module attributes `init_tinker_client` replaces."""


def init_tinker_client() -> None:
    """Point `tinker.ServiceClient`, `tinker.RestClient`, `tinker.TrainingClient` and
    `tinker.SamplingClient` at the Twinkle implementations. Call it before
    `from tinker import ServiceClient`; calling it again is harmless.

    Example:
        init_tinker_client()
        import tinker
        client = tinker.ServiceClient(base_url="http://127.0.0.1:8000")
    """
    for name, cls in PATCHED.items():
        setattr(tinker, name, cls)
