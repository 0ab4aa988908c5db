"""`make bench`: run every benchmark in turn and print its table."""

from __future__ import annotations

from bench import codec, engine, server

for module in (codec, engine, server):
    print(f"== {module.__name__}")
    module.main()
    print()
