"""`make bench`: run every benchmark in turn and print its table."""

from __future__ import annotations

from bench import codec

for module in (codec,):
    print(f"== {module.__name__}")
    module.main()
    print()
