"""The floors hold: the server never loads its clients' SDK, the clients never load the
server, and the contract package under both (`twinkle_wire`) loads neither side, nor torch.

Each check imports in a fresh interpreter, so what the test process already loaded (the
client, torch) cannot hide an import.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import twinkle_wire

ROOT = Path(__file__).resolve().parents[2]


def _loaded(modules: list[str], roots: tuple[str, ...]) -> list[str]:
    """The modules under `roots` that importing `modules` loads."""
    code = (f"import importlib, sys\nfor name in {modules!r}: importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {roots!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_the_server_imports_nothing_of_twinkle_client():
    assert _loaded(["twinkle_server.server"], ("twinkle_client",)) == []


def test_the_contract_imports_neither_side_nor_torch():
    modules = [info.name for info in pkgutil.walk_packages(twinkle_wire.__path__, "twinkle_wire.")]
    assert "twinkle_wire.datums" in modules and "twinkle_wire._proto.twinkle.v1.common_pb2" in modules
    assert _loaded(["twinkle_wire", *modules],
                   ("twinkle_server", "twinkle_client", "tinker_compat", "torch")) == []


def test_the_clients_import_nothing_of_the_server():
    import tinker_compat
    import twinkle_client

    modules = [info.name for package in (twinkle_client, tinker_compat)
               for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")]
    assert "twinkle_client.api.training" in modules and "tinker_compat.convert" in modules
    assert _loaded(modules, ("twinkle_server",)) == []
