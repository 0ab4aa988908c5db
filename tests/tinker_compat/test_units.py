"""Quick tests with no server: endpoint resolution, the status -> exception mapping, and
the tinker.types conversions (stop semantics, input features)."""

from __future__ import annotations

import concurrent.futures
import pickle

import grpc
import numpy as np
import pytest
import tinker
from tinker import types

from tinker_compat import convert, datum_to_input_feature, input_feature_to_datum
from tinker_compat.errors import error_factory
from tinker_compat.futures import APIFuture
from tinker_compat.rest_client import resolve_endpoint
from twinkle_client import errors as native

ENV = ("TWINKLE_BASE_URL", "TINKER_BASE_URL", "TWINKLE_API_KEY", "TINKER_API_KEY")


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_base_url_and_key_come_from_argument_then_twinkle_env_then_tinker_env(clean_env):
    clean_env.setenv("TINKER_BASE_URL", "http://tinker:1")
    clean_env.setenv("TINKER_API_KEY", "tk")
    assert resolve_endpoint() == ("http://tinker:1", "tk")
    clean_env.setenv("TWINKLE_BASE_URL", "http://twinkle:2")
    clean_env.setenv("TWINKLE_API_KEY", "tw")
    assert resolve_endpoint() == ("http://twinkle:2", "tw")
    assert resolve_endpoint("http://arg:3", "ak") == ("http://arg:3", "ak")


def test_empty_env_values_are_skipped_and_a_missing_key_means_an_open_server(clean_env):
    clean_env.setenv("TWINKLE_BASE_URL", "")
    clean_env.setenv("TINKER_BASE_URL", "http://tinker:1")
    clean_env.setenv("TWINKLE_API_KEY", "")
    assert resolve_endpoint() == ("http://tinker:1", None)


def test_no_base_url_anywhere_names_the_argument_and_both_variables(clean_env):
    with pytest.raises(ValueError, match="base_url.*TWINKLE_BASE_URL.*TINKER_BASE_URL"):
        resolve_endpoint()


@pytest.mark.parametrize(("code", "tinker_class", "native_class", "http_status"), [
    (grpc.StatusCode.INVALID_ARGUMENT, tinker.BadRequestError, native.InvalidArgumentError, 400),
    (grpc.StatusCode.OUT_OF_RANGE, tinker.BadRequestError, native.InvalidArgumentError, 400),
    (grpc.StatusCode.UNAUTHENTICATED, tinker.AuthenticationError, native.AuthenticationError,
     401),
    (grpc.StatusCode.PERMISSION_DENIED, tinker.PermissionDeniedError,
     native.PermissionDeniedError, 403),
    (grpc.StatusCode.NOT_FOUND, tinker.NotFoundError, native.NotFoundError, 404),
    (grpc.StatusCode.FAILED_PRECONDITION, tinker.ConflictError, native.FailedPreconditionError,
     409),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, tinker.RateLimitError, native.ResourceExhaustedError,
     429),
    (grpc.StatusCode.INTERNAL, tinker.InternalServerError, native.InternalServerError, 500),
    (grpc.StatusCode.DATA_LOSS, tinker.InternalServerError, native.InternalServerError, 500),
    (grpc.StatusCode.CANCELLED, tinker.APIStatusError, native.CancelledError, 499),
    (grpc.StatusCode.UNAVAILABLE, tinker.APIConnectionError, native.UnavailableError, None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, tinker.APITimeoutError, native.DeadlineExceededError,
     None),
])
def test_each_grpc_status_becomes_the_matching_tinker_and_twinkle_exception_with_the_message(
        code, tinker_class, native_class, http_status):
    factory = error_factory("127.0.0.1:9")
    exc = factory(native.category_of(code), "data: more than 8 tokens", "ForwardBackward")
    assert isinstance(exc, tinker_class) and isinstance(exc, native_class)
    assert isinstance(exc, tinker.TinkerError)
    assert str(exc) == exc.message == "data: more than 8 tokens"
    assert exc.request.url == "grpc://127.0.0.1:9/ForwardBackward"
    assert getattr(exc, "status_code", None) == http_status
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and str(again) == str(exc)


@pytest.mark.parametrize(("category", "kind"), [
    ("invalid_argument", "user"), ("not_found", "user"), ("failed_precondition", "user"),
    ("resource_exhausted", "user"), ("cancelled", "user"), ("internal", "server")])
def test_a_futured_ops_failure_is_also_the_sdks_request_failed_error(category, kind):
    """The stock SDK raises `RequestFailedError` (category user or server) for an op that
    failed after it was accepted, a status error for one refused at once; over gRPC the
    two cannot be told apart, so a futured op's error is both, and code written against
    either `except` catches it. Once it was only the status error."""
    factory = error_factory("x:1")
    for method in ("ForwardBackward", "Forward", "OptimStep", "SaveState", "LoadState",
                   "SaveWeightsForSampler", "Sample", "ComputeLogprobs", "CreateModel"):
        exc = factory(category, "adam_params.learning_rate: must be >= 0", method)
        assert isinstance(exc, tinker.RequestFailedError), method
        assert isinstance(exc, type(factory(category, "m", "GetRun"))), method
        assert exc.category == types.RequestErrorCategory(kind), method
        assert (exc.message, exc.request_id) == ("adam_params.learning_rate: must be >= 0", "")
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is type(exc) and again.category == exc.category
    assert not isinstance(factory(category, "m", "GetRun"), tinker.RequestFailedError)
    assert not isinstance(factory("unavailable", "m", "Sample"), tinker.RequestFailedError)


def test_futures_are_tinker_api_futures_and_failed_ones_raise_their_error():
    error = error_factory("x:1")("not_found", "run_id: no run 'r'", "GetRun")
    future = APIFuture.failed(error)
    assert isinstance(future, tinker.APIFuture) and future.done()
    assert future.exception() is error
    with pytest.raises(tinker.NotFoundError, match="no run 'r'"):
        future.result()
    assert isinstance(future.future(), concurrent.futures.Future)


@pytest.mark.parametrize(("stop", "strings", "ids", "ignore_eos"), [
    (None, [], [], False),
    ([], [], [], True),
    ("\n", ["\n"], [], False),
    (["a", "bc"], ["a", "bc"], [], False),
    ([7, 9], [], [7, 9], False),
])
def test_tinker_stop_maps_to_stop_strings_token_ids_or_ignore_eos(stop, strings, ids,
                                                                   ignore_eos):
    spec = convert.sampling_spec(types.SamplingParams(max_tokens=4, stop=stop))
    assert list(spec.stop_strings) == strings and list(spec.stop_token_ids) == ids
    assert spec.ignore_eos is ignore_eos
    assert spec.top_k == -1 and spec.seed is None


@pytest.mark.parametrize("stop", [[""], [-1], [3, -2]])
def test_empty_or_negative_stop_entries_are_refused_naming_the_field(stop):
    with pytest.raises(ValueError, match="sampling_params.stop"):
        convert.sampling_spec(types.SamplingParams(stop=stop))


def test_input_feature_becomes_a_datum_with_targets_and_weights_and_converts_back():
    feature = {"input_ids": np.array([5, 6, 7, 8]), "labels": np.array([-100, 7, 8, 2])}
    datum = input_feature_to_datum(feature)
    assert datum.model_input.to_ints() == [5, 6, 7, 8]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [0, 7, 8, 2]
    assert datum.loss_fn_inputs["weights"].tolist() == [0.0, 1.0, 1.0, 1.0]
    back = datum_to_input_feature(datum)
    assert back["input_ids"].tolist() == [5, 6, 7, 8]
    assert back["labels"].tolist() == [-100, 7, 8, 2]


def test_a_batched_feature_is_refused_with_the_shape():
    with pytest.raises(ValueError, match=r"feature.input_ids.*\[2, 2\]"):
        input_feature_to_datum({"input_ids": np.ones((2, 2), np.int64),
                                "labels": np.ones((2, 2), np.int64)})


def test_loss_config_must_be_numeric_and_names_the_key():
    with pytest.raises(ValueError, match=r"loss_fn_config\['clip_low_threshold'\]"):
        convert.loss_spec("ppo", {"clip_low_threshold": "low"})


def test_checkpoint_paths_are_shown_in_tinker_form():
    assert convert.tinker_path("twinkle://run-1/sampler_weights/a") == \
        "tinker://run-1/sampler_weights/a"
