"""`init_tinker_client()` turns `tinker.ServiceClient` into Twinkle's; without the call
the real SDK is untouched."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tinker
from tinker import types

import tinker_compat
from tinker_compat.shim import PATCHED

from .conftest import sft_data

pytestmark = pytest.mark.integration


@pytest.fixture
def restore_tinker(monkeypatch):
    """Put tinker's own attributes back after the test, whatever it patched."""
    for name in PATCHED:
        monkeypatch.setattr(tinker, name, getattr(tinker, name))


def test_after_init_tinker_client_tinker_service_client_trains_on_twinkle(restore_tinker,
                                                                          base_url):
    tinker_compat.init_tinker_client()
    from tinker import ServiceClient

    assert ServiceClient is tinker.ServiceClient is tinker_compat.ServiceClient
    assert tinker.RestClient is tinker_compat.RestClient
    service_client = tinker.ServiceClient(base_url=base_url)
    try:
        training_client = service_client.create_lora_training_client(
            base_model="tiny", rank=4).result()
        assert isinstance(training_client, tinker.TrainingClient)
        result = training_client.forward_backward(sft_data(1), "cross_entropy").result()
        assert isinstance(result, types.ForwardBackwardOutput)
    finally:
        service_client.close()


def test_without_the_call_importing_tinker_compat_leaves_the_real_sdk_untouched():
    check = ("import tinker, tinker_compat\n"
             "from tinker.lib.public_interfaces import RestClient, ServiceClient\n"
             "assert tinker.ServiceClient is ServiceClient, tinker.ServiceClient\n"
             "assert tinker.RestClient is RestClient\n"
             "assert tinker.ServiceClient is not tinker_compat.ServiceClient\n"
             "print('untouched')\n")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "untouched", out.stderr
