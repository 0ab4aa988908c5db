"""The Tinker REST routes of sampling: sampling sessions and `asample`, the body turned
into the runtime's values (`convert`, `sampling_options`) and checked once by
`runtime.sampling` before anything is queued: a bad parameter is a 400 naming it."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.http import convert, sampling_options
from twinkle_server.http.app import API_PREFIX, Front, json_body, route
from twinkle_server.runtime import checkpoint_ref
from twinkle_server.runtime.bases import ONCE_QUEUE
from twinkle_server.runtime.sampling import Source


class SamplingRoutes:
    """The SDK's `SamplingClient` routes over the front's auth and futures."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.rt = front.rt

    @route
    async def create_sampling_session(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        body = await json_body(request)
        text = convert.text(body, "model_path")
        sampler = await self.rt.sampling.create_session(
            tenant, convert.text(body, "session_id"),
            model_path=checkpoint_ref(text, "model_path") if text else None,
            base_model=convert.text(body, "base_model"))
        return {"type": "create_sampling_session", "sampling_session_id": sampler}

    @route
    async def get_sampler(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        sampler = request.path_params["sampler_id"]
        entry = self.rt.sampler_of(tenant, sampler)
        return {"sampler_id": sampler, "base_model": entry.base_model,
                "model_path": entry.model_path}

    @route
    async def asample(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        body = await json_body(request)
        rid = self.front._id()
        sampler = convert.text(body, "sampling_session_id")
        prompt = convert.prompt_tokens(body)
        params = convert.sampling_params(body)
        num_samples = convert.integer(body, "num_samples", 1, low=1)
        include = convert.flag(body, "prompt_logprobs")
        topk = convert.integer(body, "topk_prompt_logprobs", 0) or 0
        options = sampling_options.read(body)
        recorded = convert.flag(body, "record_stability_info")
        if sampler:
            target = self.rt.sampling.target(tenant, None, sampler, rid)
            work = self.rt.sampling.sample(
                target, prompt, num_samples, params, include, topk,
                topk_sample_logprobs=options.topk_sample_logprobs,
                prompt_options=options.prompt)
            queue = target.queue
        else:   # the SDK types' alternative to a session: a checkpoint or a base
            work = self.rt.sampling.sample_from(
                self._source(tenant, body), prompt, num_samples, params,
                include_prompt_logprobs=include, topk_prompt_logprobs=topk,
                topk_sample_logprobs=options.topk_sample_logprobs,
                prompt_options=options.prompt)
            queue = ONCE_QUEUE
        # Fixed at submission (the SDK reads them off the promise); kept, with what
        # stable_reinforce needs, when the request asks to record (`runtime.stability`).
        ids = self.rt.stability.new_ids(num_samples)
        if recorded:
            work = self.rt.stability.recorded(tenant, queue, prompt, ids, work)
        return await self.front.promise(
            tenant, rid, work,
            lambda result: Response(sampling_options.sample_response(result, include, options),
                                    media_type=convert.PROTOBUF),
            sample_sequence_ids=ids)

    def _source(self, tenant: str, body: dict[str, Any]) -> Source:
        """What a sample without a session reads: `model_path` (a sampler checkpoint the
        tenant may read), else `base_model`; one of the three is required."""
        path = convert.text(body, "model_path")
        base = convert.text(body, "base_model")
        if not (path or base):
            raise InvalidArgument("sampling_session_id: required unless model_path or "
                                  "base_model names what to sample; create a sampling client "
                                  "with ServiceClient.create_sampling_client")
        return self.rt.sampling.source(
            tenant, checkpoint_ref(path, "model_path") if path else None, base or "")

    def routes(self) -> list[Route]:
        table = [
            ("POST", "/create_sampling_session", self.create_sampling_session),
            ("GET", "/samplers/{sampler_id}", self.get_sampler),
            ("POST", "/asample", self.asample),
        ]
        return [Route(API_PREFIX + path, fn, methods=[method]) for method, path, fn in table]
