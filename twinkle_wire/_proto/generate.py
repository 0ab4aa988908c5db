"""Regenerate the committed gRPC stubs from `protos/` (run by `make proto`).

protoc writes `from twinkle.v1 import x_pb2`; the stubs live inside this package, so
those imports are rewritten to absolute ones. The output is deterministic for a given
grpcio-tools version, which `.ci/run` relies on to check that the stubs are fresh.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
OUT = Path(__file__).resolve().parent
PACKAGE = "twinkle_wire._proto"
GENERATED = OUT / "twinkle"


def generate() -> list[Path]:
    """Run protoc on every .proto under protos/ and fix the imports; returns the files written."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    if GENERATED.exists():
        shutil.rmtree(GENERATED)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    written = sorted(p for p in GENERATED.rglob("*") if p.suffix in {".py", ".pyi"})
    for path in written:
        text = path.read_text()
        text = re.sub(r"^from twinkle\.v1 import", f"from {PACKAGE}.twinkle.v1 import", text,
                      flags=re.M)
        path.write_text(text)
    for folder in {p.parent for p in written} | {GENERATED}:
        (folder / "__init__.py").touch()
    return written


if __name__ == "__main__":
    files = generate()
    print(f"generated {len(files)} files under {GENERATED.relative_to(ROOT)}", file=sys.stderr)
