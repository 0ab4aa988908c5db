"""The Tinker API over a Twinkle server: change one import and existing Tinker code runs.

    from tinker_compat import ServiceClient        # instead of: from tinker import ServiceClient

or call `init_tinker_client()` before `from tinker import ServiceClient`. Results are
`tinker.types` objects, futures are `tinker.APIFuture`s, errors subclass `tinker.TinkerError`.
Code that builds a dataset before its ServiceClient finds the server for the tokenizer in
`TWINKLE_BASE_URL` (or `TINKER_BASE_URL`), or from `init_tinker_client(base_url=...)`.

Modules: `service_client`, `training_client` (with `training_weights`, its checkpoints and
sampling clients), `sampling_client`, `rest_client` (with `rest_weights`, its downloads,
uploads and copies): the four clients; `futures` (APIFuture and the client futures),
`errors` (gRPC status -> Tinker exception), `convert` (proto <-> tinker.types, input
features <-> Datums), `shim` (`init_tinker_client`).
"""

from tinker_compat.convert import datum_to_input_feature, input_feature_to_datum
from tinker_compat.rest_client import RestClient
from tinker_compat.sampling_client import SamplingClient
from tinker_compat.service_client import ServiceClient
from tinker_compat.shim import init_tinker_client
from tinker_compat.training_client import TrainingClient

__all__ = [
    "RestClient",
    "SamplingClient",
    "ServiceClient",
    "TrainingClient",
    "datum_to_input_feature",
    "init_tinker_client",
    "input_feature_to_datum",
]
