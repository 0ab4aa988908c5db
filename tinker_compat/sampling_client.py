"""Tinker's `SamplingClient` over a Twinkle sampling session.

A session samples from one fixed set of weights: a saved sampler checkpoint
(`tinker://<run>/sampler_weights/<name>`) or the bare base model. Samples run on the
server's sampler queue, unordered with respect to training ops, as in Tinker; cancelling a
sample's future stops it on the server. A client pickles, as tinker's does, for use in
other processes: the copy reconnects (one connection per process and server).
"""

from __future__ import annotations

import base64
import json
import threading
from typing import TYPE_CHECKING, Any

from tinker import types

from tinker_compat import convert, sampling_options
from tinker_compat.errors import error_factory
from tinker_compat.futures import (
    APIFuture,
    ClientFuture,
    SampleFuture,
    client_future,
    deprecated,
)
from twinkle_client import api
from twinkle_client.connection import Connection, env_endpoint, parse_base_url
from twinkle_client.errors import require_int
from twinkle_client.tokenizer import load_tokenizer
from twinkle_wire import paths

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class SamplingClient:
    """Generates text and scores prompts with one fixed set of weights.

    You get one from `ServiceClient.create_sampling_client(...)` or
    `TrainingClient.save_weights_and_get_sampling_client()`.

    Example:
        sampling_client = service_client.create_sampling_client(base_model="tiny").result()
        prompt = types.ModelInput.from_ints(tokenizer.encode("Hello"))
        result = sampling_client.sample(prompt, 4, types.SamplingParams(max_tokens=20)).result()
    """

    def __init__(self, connection: Connection, sampling_session_id: str, base_model: str,
                 model_path: str | None = None, record_stability_info: bool = False) -> None:
        self._conn = connection
        self._record_stability_info = record_stability_info
        self.sampling_session_id = sampling_session_id
        self.model_path = convert.tinker_path(model_path) if model_path else None
        self._base_model = base_model

    def __repr__(self) -> str:
        source = self.model_path or self._base_model
        return f"<SamplingClient {self.sampling_session_id} of {source}>"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle for another process, as tinker's client: the copy reconnects with this
        client's URL, key and CA, opens no session of its own, and samples from the same
        sampling session, which lives as long as the session of the client that made it."""
        conn = self._conn
        return (_unpickle, (conn.base_url, conn.api_key, conn.root_certificates,
                            self.sampling_session_id, self._base_model, self.model_path,
                            self._record_stability_info))

    def get_telemetry(self) -> None:
        """None, the SDK's answer when it has no telemetry: Twinkle's clients report none."""
        return None

    def get_sampler_handle(self) -> str:
        """A string handle to this client's sampler, for other processes without pickle,
        as tinker's: every `SamplingClient.from_sampler_handle` of it, anywhere and any
        number of times, makes a new client of the same sampler. It carries no key.

        Example:
        ```python
        handle = sampling_client.get_sampler_handle()
        # in another process
        sampling_client = SamplingClient.from_sampler_handle(handle)
        ```
        """
        conn = self._conn
        certificates = conn.root_certificates
        fields = {"base_url": conn.base_url,
                  "root_certificates": (base64.b64encode(certificates).decode()
                                        if certificates else None),
                  "sampling_session_id": self.sampling_session_id,
                  "base_model": self._base_model, "model_path": self.model_path,
                  "record_stability_info": self._record_stability_info}
        return base64.urlsafe_b64encode(json.dumps(fields).encode()).decode()

    @staticmethod
    def from_sampler_handle(handle: str, *, api_key: str | None = None) -> SamplingClient:
        """A new client of the sampler behind `handle` (`get_sampler_handle`), with
        `api_key`, else this process's key as a `ServiceClient` resolves it
        (`TWINKLE_API_KEY`, then `TINKER_API_KEY`)."""
        try:
            fields = json.loads(base64.urlsafe_b64decode(handle))
            certificates = fields["root_certificates"]
            return _unpickle(fields["base_url"], env_endpoint(None, api_key)[1],
                             base64.b64decode(certificates) if certificates else None,
                             fields["sampling_session_id"], fields["base_model"],
                             fields["model_path"], fields["record_stability_info"])
        except (ValueError, TypeError, KeyError):
            raise ValueError(f"handle: not a sampler handle from get_sampler_handle, got "
                             f"{handle!r:.60}") from None

    def sample(self, prompt: types.ModelInput, num_samples: int,
               sampling_params: types.SamplingParams, include_prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
               target_prompt_logprobs: types.TensorData | None = None,
               prompt_alt_tokens_k: int = 0, prompt_logprobs_last_n: int | None = None
               ) -> APIFuture[types.SampleResponse]:
        """Generate `num_samples` completions of `prompt`.

        Args:
        - `prompt`: the input tokens as ModelInput
        - `num_samples`: number of independent samples (>= 1)
        - `sampling_params`: max_tokens, temperature, top_p, top_k (-1 = no limit), seed,
          stop (None: stop at EOS; []: never stop early, EOS included; strings or token ids)
        - `include_prompt_logprobs`: also return the logprob of every prompt token
          (`prompt_logprobs`, None at position 0)
        - `topk_prompt_logprobs`: k > 0 also returns the k most likely tokens at each prompt
          position (`topk_prompt_logprobs`, None at position 0); at most 20
        - `topk_sample_logprobs`: k > 0 also returns the k most likely tokens at each
          sampled position (`SampledSequence.topk_logprobs`); at most 20
        - `target_prompt_logprobs`: int64 `TensorData` `[len(prompt) - 1, K]` (dense or
          sparse CSR, -1 = none): row i names ids to score at prompt position i + 1;
          returned as `SampleResponse.target_prompt_logprobs` in the same layout, 0.0
          where -1; at most 64 distinct ids
        - `prompt_alt_tokens_k`: k draws at the request's temperature from the
          next-token distribution at each prompt position after the first
          (`SampleResponse.prompt_alt_tokens`, two `[len(prompt) - 1, k]` tensors); <= 20
        - `prompt_logprobs_last_n`: score only the last N prompt tokens (earlier entries
          None; top-k rows too); needs `include_prompt_logprobs`

        Returns:
        - `APIFuture` of the `SampleResponse`: one `SampledSequence` per sample, with
          `tokens`, `logprobs` and `stop_reason`.

        Example:
        ```python
        params = types.SamplingParams(max_tokens=20, temperature=0.7, seed=0)
        result = sampling_client.sample(prompt, num_samples=2, sampling_params=params).result()
        for sequence in result.sequences:
            print(tokenizer.decode(sequence.tokens), sum(sequence.logprobs))
        ```
        """
        require_int(num_samples, "num_samples", minimum=0)   # 0: the server refuses it
        require_int(topk_prompt_logprobs, "topk_prompt_logprobs", minimum=0)
        sampling_options.check(topk_sample_logprobs=topk_sample_logprobs,
                               prompt_alt_tokens_k=prompt_alt_tokens_k,
                               prompt_logprobs_last_n=prompt_logprobs_last_n,
                               include_prompt_logprobs=include_prompt_logprobs,
                               target_prompt_logprobs=target_prompt_logprobs)
        try:
            spec = convert.sampling_spec(sampling_params)
        except convert.Refused as exc:
            return SampleFuture.failed(
                self._conn.error_factory("invalid_argument", str(exc), "Sample"))
        call = api.sample(self.sampling_session_id, convert.prompt_tokens(prompt), num_samples,
                          spec, include_prompt_logprobs,
                          topk_prompt_logprobs, topk_sample_logprobs=topk_sample_logprobs,
                          target_prompt_logprobs=(
                              None if target_prompt_logprobs is None
                              else sampling_options.dense_targets(target_prompt_logprobs)),
                          prompt_alt_tokens_k=prompt_alt_tokens_k,
                          prompt_logprobs_last_n=prompt_logprobs_last_n,
                          record_stability_info=self._record_stability_info)

        def run() -> types.SampleResponse:
            result = call.send(self._conn)
            return sampling_options.extend_response(
                convert.sample_response_to_tinker(result, include_prompt_logprobs), result,
                target_prompt_logprobs)

        return self._conn.submit(run, future_class=SampleFuture, interruptible=True)

    @deprecated("DEPRECATED: SamplingClient.sample_async() is deprecated. Use `await "
                "SamplingClient.sample(...)` instead; sample() returns an APIFuture that can be "
                "awaited.")
    async def sample_async(self, prompt: types.ModelInput, num_samples: int,
                           sampling_params: types.SamplingParams,
                           include_prompt_logprobs: bool = False,
                           topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
                           target_prompt_logprobs: types.TensorData | None = None,
                           prompt_alt_tokens_k: int = 0,
                           prompt_logprobs_last_n: int | None = None) -> types.SampleResponse:
        """Deprecated: use `await sampling_client.sample(...)`."""
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                 topk_prompt_logprobs, topk_sample_logprobs,
                                 target_prompt_logprobs, prompt_alt_tokens_k,
                                 prompt_logprobs_last_n)

    def compute_logprobs(self, prompt: types.ModelInput,
                         prompt_logprobs_last_n: int | None = None
                         ) -> APIFuture[list[float | None]]:
        """The log probability of each prompt token given the ones before it.

        Args:
        - `prompt`: the tokens to score
        - `prompt_logprobs_last_n`: score only the last N tokens (1 .. len(prompt) - 1);
          earlier entries are None

        Returns:
        - `APIFuture` of a list as long as the prompt; None at position 0 (no context).

        Example:
        ```python
        logprobs = sampling_client.compute_logprobs(prompt).result()
        total = sum(lp for lp in logprobs if lp is not None)
        ```
        """
        if prompt_logprobs_last_n is not None:
            require_int(prompt_logprobs_last_n, "prompt_logprobs_last_n", minimum=1)
        call = api.compute_logprobs(self.sampling_session_id, convert.prompt_tokens(prompt),
                                    prompt_logprobs_last_n)

        def run() -> list[float | None]:
            return convert.logprobs_list(call.send(self._conn))

        return self._conn.submit(run, future_class=SampleFuture, interruptible=True)

    @deprecated("DEPRECATED: SamplingClient.compute_logprobs_async() is deprecated. Use `await "
                "SamplingClient.compute_logprobs(...)` instead.")
    async def compute_logprobs_async(self, prompt: types.ModelInput,
                                     prompt_logprobs_last_n: int | None = None
                                     ) -> list[float | None]:
        """Deprecated: use `await sampling_client.compute_logprobs(...)`."""
        return await self.compute_logprobs(prompt, prompt_logprobs_last_n)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The base model's tokenizer, fetched from the server once per process (no hub).

        Example:
        ```python
        tokenizer = sampling_client.get_tokenizer()
        prompt = types.ModelInput.from_ints(tokenizer.encode("Hello"))
        ```
        """
        return load_tokenizer(self._base_model, self._conn)

    def get_base_model(self) -> str:
        """The base model name of this sampler; known locally, never waits."""
        return self._base_model

    @deprecated("DEPRECATED: SamplingClient.get_base_model_async() is deprecated. Use "
                "SamplingClient.get_base_model() instead.")
    async def get_base_model_async(self) -> str:
        """Deprecated: use `sampling_client.get_base_model()`."""
        return self._base_model


SamplingClientFuture: type[ClientFuture] = client_future(SamplingClient, "SamplingClient")

_copies_connections: dict[tuple[str, str | None, bytes | None], Connection] = {}
_copies_lock = threading.Lock()


def _unpickle(base_url: str, api_key: str | None, root_certificates: bytes | None,
              sampling_session_id: str, base_model: str, model_path: str | None,
              record_stability_info: bool) -> SamplingClient:
    """A pickled SamplingClient in this process, on the process's one connection to the
    server for that key (made at the first copy, sessionless)."""
    key = (base_url, api_key, root_certificates)
    with _copies_lock:
        conn = _copies_connections.get(key)
        if conn is None or conn.closed:
            conn = _copies_connections[key] = Connection(
                base_url, api_key, client_name="tinker_compat/0.1",
                error_factory=error_factory(parse_base_url(base_url)[0]),
                root_certificates=root_certificates, open_session=False)
    return SamplingClient(conn, sampling_session_id, base_model, model_path,
                          record_stability_info)


def open_sampling_client(connection: Connection, *, model_path: str | None = None,
                         base_model: str | None = None,
                         record_stability_info: bool = False) -> SamplingClient:
    """Create a sampling session (blocking): on a sampler checkpoint, else the base model."""
    if model_path:
        paths.parse(model_path, "model_path")
        call = api.create_sampling_session(model_path=model_path)
    elif base_model:
        call = api.create_sampling_session(base_model=base_model)
    else:
        raise ValueError("Either model_path or base_model must be provided")
    info = call.send(connection)
    return SamplingClient(connection, info.sampling_session_id, info.base_model,
                          info.model_path or None, record_stability_info)


def submit_sampling_client(connection: Connection, *, model_path: str | None = None,
                           base_model: str | None = None, retry_config: Any = None,
                           record_stability_info: bool = False) -> ClientFuture:
    """`open_sampling_client` on the call pool; bad arguments raise here, at once."""
    check_sampling_options(retry_config=retry_config, record_stability_info=record_stability_info)
    if model_path:
        paths.parse(model_path, "model_path")
    elif not base_model:
        raise ValueError("Either model_path or base_model must be provided")
    return connection.submit(open_sampling_client, connection, model_path=model_path,
                             base_model=base_model, record_stability_info=record_stability_info,
                             future_class=SamplingClientFuture)


def check_sampling_options(*, retry_config: Any, record_stability_info: bool) -> None:
    """Tinker's sampling-client options: `retry_config` is accepted and unused (the
    connection retries unreachable-server errors itself); `record_stability_info` must be
    a bool (True: every sample records its sequences for stable_reinforce)."""
    del retry_config
    if not isinstance(record_stability_info, bool):
        raise ValueError(f"record_stability_info: expected a bool, got "
                         f"{record_stability_info!r}")
