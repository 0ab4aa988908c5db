"""The wings hold: each package of the server imports only what the map in
`twinkle_server/__init__.py` lets it.

- `scheduling` sees one `EngineAPI` and knows no tenant: it never imports `ranks`, the
  runtime or a front;
- `ranks` builds an engine over processes and knows no tenant, queue or wire: it never
  imports the runtime, `scheduling` or a front;
- the runtime and the fronts see that engine only as an `EngineAPI`: they never import
  `ranks`;
- the runtime, the fronts and `scheduling` reach the engine only through its public
  modules (`twinkle_server.engine.PUBLIC_MODULES`);
- `config` stands on the engine alone, and the engine and the store on nothing of the
  server; no package imports the entry or the assembly (`cli`, `server`, `process`).

Imports are read from the source (ast), so one inside a function counts as much as one at
the top; a fresh interpreter then checks what importing a package really loads, which
also catches imports made by name (`importlib`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from twinkle_server.engine import PUBLIC_MODULES

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "twinkle_server"
PACKAGES = ("engine", "config", "scheduling", "ranks", "store", "runtime", "service", "http")
ROOT_MODULES = ("cli", "server", "process")
FRONTS = ("service", "http")


def _all_but(*mine: str) -> tuple[str, ...]:
    return tuple(p for p in PACKAGES if p not in mine)


FORBIDDEN: dict[str, tuple[str, ...]] = {
    "scheduling": ("ranks", "runtime", *FRONTS),
    "ranks": ("runtime", "scheduling", *FRONTS),
    "runtime": ("ranks",),
    "service": ("ranks",),
    "http": ("ranks",),
    "config": _all_but("config", "engine"),
    "engine": _all_but("engine"),
    "store": _all_but("store"),
}
"""What each package must not import, besides the root modules."""

THROUGH_THE_FACE = ("runtime", *FRONTS, "scheduling")
"""The packages that reach the engine only through its public modules."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in the file, wherever it stands; `from package
    import name` names the submodule when `name` is one."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if _is_module(sub) else base


def _server_imports(package: str) -> Iterator[tuple[str, str]]:
    """('file:line', module) for every import of the server's own modules in `package`,
    each once."""
    for path in sorted((SERVER / package).rglob("*.py")):
        yield from dict.fromkeys((f"{path.relative_to(ROOT)}:{line}", module)
                                 for line, module in _imports(path)
                                 if module.startswith("twinkle_server."))


def _part(module: str) -> str:
    """The package or root module of the server that `module` belongs to."""
    return module.split(".")[1]


def _loaded(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    """The modules starting with one of `prefixes` that importing `modules` loads, in a
    fresh interpreter."""
    code = (f"import importlib, sys\nfor name in {modules!r}: importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def _modules_of(*packages: str) -> list[str]:
    return [_module_name(path) for package in packages
            for path in sorted((SERVER / package).rglob("*.py"))]


def test_the_map_names_every_package_and_root_module():
    found = {p.name for p in SERVER.iterdir() if (p / "__init__.py").is_file()}
    assert found == set(PACKAGES)
    assert {p.stem for p in SERVER.glob("*.py")} == {"__init__", *ROOT_MODULES}
    import twinkle_server

    for name in (*PACKAGES, *ROOT_MODULES):
        assert f"`{name}" in twinkle_server.__doc__, f"twinkle_server/__init__.py omits {name}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_each_package_imports_only_what_the_map_allows(package):
    forbidden = FORBIDDEN[package] + ROOT_MODULES
    reached = [f"{where} imports {module}" for where, module in _server_imports(package)
               if _part(module) in forbidden]
    assert reached == [], (f"twinkle_server/{package} must not import {', '.join(forbidden)} "
                           f"(the map in twinkle_server/__init__.py):\n" + "\n".join(reached))


@pytest.mark.parametrize("package", THROUGH_THE_FACE)
def test_the_engine_is_reached_only_through_its_public_modules(package):
    reached = [f"{where} imports {module}" for where, module in _server_imports(package)
               if _part(module) == "engine" and module not in PUBLIC_MODULES]
    assert reached == [], (f"twinkle_server/{package} reaches past the engine's public modules "
                           f"{list(PUBLIC_MODULES)}: re-export what it needs there instead:\n"
                           + "\n".join(reached))


def test_the_public_modules_exist():
    assert all(_is_module(name) for name in PUBLIC_MODULES), PUBLIC_MODULES


def test_loaded_whole_the_runtime_and_the_fronts_load_nothing_of_ranks():
    assert _loaded(_modules_of("runtime", *FRONTS), ("twinkle_server.ranks",)) == []


def test_loaded_whole_scheduling_loads_neither_ranks_nor_the_runtime_nor_a_front():
    wings = tuple(f"twinkle_server.{p}" for p in ("ranks", "runtime", *FRONTS))
    assert _loaded(_modules_of("scheduling"), wings) == []
