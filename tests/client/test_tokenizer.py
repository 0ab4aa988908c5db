"""Where `load_tokenizer` finds the server when none is passed: the default connection,
else `TWINKLE_BASE_URL`/`TINKER_BASE_URL`, else a clear error; and
`init_tinker_client(base_url=...)` as a way to set that default (the seed article builds
its dataset before its ServiceClient)."""

from __future__ import annotations

import pytest
import tinker

from tinker_compat import init_tinker_client, shim
from twinkle_client import tokenizer
from twinkle_client.connection import (
    API_KEY_ENV,
    BASE_URL_ENV,
    env_endpoint,
    get_default_connection,
    set_default_connection,
)
from twinkle_client.template import Template
from twinkle_client.tokenizer import load_tokenizer


@pytest.fixture
def clean(monkeypatch):
    """No default connection, none of the variables, an empty tokenizer cache (so a load
    really downloads) and tinker's own attributes; all restored afterwards."""
    previous = get_default_connection()
    set_default_connection(None)
    for name in (*BASE_URL_ENV, *API_KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tokenizer, "_fetched", {})
    monkeypatch.setattr(shim, "_made", None)
    for name in shim.PATCHED:
        monkeypatch.setattr(tinker, name, getattr(tinker, name))
    yield
    current = get_default_connection()
    set_default_connection(previous)
    if current is not None and current is not previous:
        current.close()


def test_env_endpoint_prefers_arguments_then_twinkle_then_tinker_variables(clean,
                                                                           monkeypatch):
    assert env_endpoint() == (None, None)
    monkeypatch.setenv("TINKER_BASE_URL", "http://tinker:1")
    monkeypatch.setenv("TINKER_API_KEY", "tk")
    assert env_endpoint() == ("http://tinker:1", "tk")
    monkeypatch.setenv("TWINKLE_BASE_URL", "http://twinkle:2")
    monkeypatch.setenv("TWINKLE_API_KEY", "tw")
    assert env_endpoint() == ("http://twinkle:2", "tw")
    assert env_endpoint("http://arg:3", "ak") == ("http://arg:3", "ak")


def test_with_no_connection_and_no_variables_the_error_names_the_variables(clean):
    with pytest.raises(ValueError, match=r"'ms://Qwen/Qwen3.5-4B' is not a local directory "
                                         r"and no Twinkle server is connected; export "
                                         r"TWINKLE_BASE_URL \(or TINKER_BASE_URL\)"):
        load_tokenizer("ms://Qwen/Qwen3.5-4B")


def test_init_tinker_client_without_arguments_connects_nothing(clean):
    init_tinker_client()
    assert tinker.ServiceClient is shim.ServiceClient
    assert get_default_connection() is None


@pytest.mark.integration
@pytest.mark.parametrize("variable", BASE_URL_ENV)
def test_with_a_base_url_variable_the_tokenizer_comes_from_that_server(clean, monkeypatch,
                                                                       server, variable):
    monkeypatch.setenv(variable, f"http://{server.address}")
    monkeypatch.setenv("TWINKLE_API_KEY", "EMPTY_TOKEN")  # an open server ignores keys
    template = Template(model_id="ms://tiny", max_length=64)  # what set_template builds
    assert template.tokenizer.decode(template.tokenizer("hello world")["input_ids"]
                                     ) == "hello world"
    assert load_tokenizer("tiny") is template.tokenizer  # fetched once per server
    # The download's connection is closed, not left behind as the default.
    assert get_default_connection() is None


@pytest.mark.integration
def test_init_tinker_client_with_base_url_sets_the_default_connection(clean, server):
    url = f"http://{server.address}"
    init_tinker_client(base_url=url, api_key="EMPTY_TOKEN")
    first = get_default_connection()
    assert first is not None and first.base_url == url and first.session_id is None
    assert first.metadata == (("authorization", "Bearer EMPTY_TOKEN"),)
    assert tinker.ServiceClient is shim.ServiceClient
    assert load_tokenizer("ms://tiny").chat_template
    # Calling it again replaces (and closes) the connection the first call made.
    with pytest.warns(FutureWarning, match="ignores unsupported arguments: project"):
        init_tinker_client(base_url=url, project="x")
    assert get_default_connection() is not first and first.closed
    assert get_default_connection().metadata == ()


def test_init_tinker_client_with_a_key_but_no_url_anywhere_says_so(clean):
    with pytest.raises(ValueError, match="base_url: not given, and neither TWINKLE_BASE_URL "
                                         "nor TINKER_BASE_URL is set"):
        init_tinker_client(api_key="k")
    assert get_default_connection() is None
