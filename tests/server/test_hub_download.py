"""`twinkle-server serve` with a model by hub id, against a local stand-in for the hub
(`HF_ENDPOINT`): a `--models` table whose path is a hub id not yet cached is downloaded,
with its progress in the log, before the server listens, and then samples;
with `--offline on` the same start is refused by name, having asked the hub nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tinker
from tinker import types

from twinkle_server.process import start_server

from ..hub_standin import hub

pytestmark = pytest.mark.integration

MODELS = """
[[models]]
name = "student"
path = "Org/Tiny"
"""


def test_a_hub_id_downloads_before_the_server_listens_and_then_serves(
        tiny_cache, tmp_path, monkeypatch):
    from twinkle_server.engine.tiny_model import build_tiny_model

    models = tmp_path / "models.toml"
    models.write_text(MODELS)
    with hub({"Org/Tiny": build_tiny_model(tiny_cache)}) as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{stand_in.server_address[1]}")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
        refused = subprocess.run(
            [sys.executable, "-m", "twinkle_server.cli", "serve", "--models", str(models),
             "--offline", "on", "--data-dir", str(tmp_path / "offline")],
            capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2
        assert "'Org/Tiny' is neither a built-in" in refused.stderr
        assert "downloads are off (--offline on or HF_HUB_OFFLINE)" in refused.stderr
        assert stand_in.asked == []
        proc = start_server(tmp_path / "data", "--models", str(models), http=True)
        try:
            log = proc.log_path.read_text()
            assert "downloading Org/Tiny from http://127.0.0.1:" in log
            assert "Fetching 5 files" in log
            assert log.index("downloaded Org/Tiny") < log.index("listening on")
            service = tinker.ServiceClient(base_url=f"http://{proc.http_address}",
                                           api_key="tml-open")
            sampler = service.create_sampling_client(base_model="student")
            sampled = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1,
                                     types.SamplingParams(max_tokens=4, seed=1)).result()
            assert len(sampled.sequences[0].tokens) == 4
            service.close("success").result()
        finally:
            proc.stop()
