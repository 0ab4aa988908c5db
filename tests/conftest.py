"""Shared fixtures: the tiny model is built once per test session into a temp cache."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """A cache dir holding the tiny model; TWINKLE_CACHE_DIR points at it for subprocesses."""
    from twinkle_server.engine.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("twinkle-cache")
    build_tiny_model(root)
    os.environ["TWINKLE_CACHE_DIR"] = str(root)
    return root
