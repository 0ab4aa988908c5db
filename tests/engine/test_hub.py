"""Models by hub id (`engine.hub`), against a local stand-in for the hub's routes
(`tests/hub_standin.py`, reached through `HF_ENDPOINT`): a model not yet cached is
downloaded into the Hugging Face cache with its progress shown, then found there without
asking the hub again; offline, or for a repository without safetensors, it is refused by
name. Each case runs in a fresh process: `huggingface_hub` reads its environment once,
when imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..hub_standin import hub

FETCH = "from twinkle_server.engine import hub; print('AT', hub.fetch('{model}'))"


def _fetch(endpoint: str, home: Path, model: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", FETCH.format(model=model)], capture_output=True, text=True,
        timeout=120, env={**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(home), **env})


@pytest.fixture
def repos(tiny_cache, tmp_path):
    from twinkle_server.engine.tiny_model import build_tiny_model

    source = build_tiny_model(tiny_cache)
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    (pickles / "config.json").write_text((source / "config.json").read_text())
    (pickles / "pytorch_model.bin").write_bytes(b"not loaded")
    return {"Org/Tiny": source, "Org/Pickles": pickles}


def test_a_hub_id_not_cached_downloads_with_progress_and_then_comes_from_the_cache(
        repos, tmp_path):
    with hub(repos) as stand_in:
        endpoint = f"http://127.0.0.1:{stand_in.server_address[1]}"
        first = _fetch(endpoint, tmp_path / "home", "Org/Tiny")
        assert first.returncode == 0, first.stderr
        assert "Fetching 5 files" in first.stderr          # huggingface_hub's progress bar
        snapshot = Path(first.stdout.split("AT ", 1)[1].strip())
        assert snapshot.is_relative_to(tmp_path / "home" / "hub" / "models--Org--Tiny")
        assert sorted(p.name for p in snapshot.iterdir()) == sorted(
            p.name for p in repos["Org/Tiny"].iterdir() if not p.name.startswith("."))
        assert (snapshot / "model.safetensors").read_bytes() == (
            repos["Org/Tiny"] / "model.safetensors").read_bytes()
        asked = len(stand_in.asked)
        again = _fetch(endpoint, tmp_path / "home", "Org/Tiny")
        assert again.returncode == 0 and f"AT {snapshot}" in again.stdout, again.stderr
        assert len(stand_in.asked) == asked                 # the cache answered


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {}])
def test_offline_or_unknown_a_model_not_cached_is_refused_by_name(repos, tmp_path, env):
    with hub(repos) as stand_in:
        endpoint = f"http://127.0.0.1:{stand_in.server_address[1]}"
        model = "Org/Tiny" if env else "Org/Nothing"
        done = _fetch(endpoint, tmp_path / "home", model, **env)
        assert done.returncode != 0
        if env:
            assert "downloads are off (--offline on or HF_HUB_OFFLINE)" in done.stderr
            assert not any("/resolve/" in asked for asked in stand_in.asked)
        else:
            assert "'Org/Nothing' could not be downloaded from " + endpoint in done.stderr


def test_a_repository_without_safetensors_is_refused_naming_the_format(repos, tmp_path):
    with hub(repos) as stand_in:
        done = _fetch(f"http://127.0.0.1:{stand_in.server_address[1]}", tmp_path / "home",
                      "Org/Pickles")
    assert done.returncode != 0 and "'Org/Pickles' has no safetensors weights" in done.stderr


@pytest.mark.parametrize("model", ["/no/such/Qwen3-0.6B", "./Qwen3-0.6B", "~/nowhere/m"])
def test_a_mistyped_local_path_is_refused_as_a_missing_directory_not_downloaded(
        repos, tmp_path, model):
    """A path (absolute, relative or home) that is no directory is a typo to name, not a
    hub id: once it went to the hub and came back as a validation error of the download."""
    with hub(repos) as stand_in:
        done = _fetch(f"http://127.0.0.1:{stand_in.server_address[1]}", tmp_path / "home",
                      model)
        assert done.returncode != 0
        assert f"model: no model directory at {model!r}" in done.stderr, done.stderr
        assert stand_in.asked == []
