"""`make bench`: run every benchmark in turn and print its table."""

from __future__ import annotations

from bench import (
    codec,
    distributed,
    engine,
    limit,
    sampling,
    server,
    split,
    tinker_compat,
    tinker_http,
    turns,
)

for module in (codec, engine, distributed, server, tinker_compat, tinker_http, sampling,
               limit, turns):
    print(f"== {module.__name__}")
    module.main()
    print()
print("== bench.split (its publication table is bench.distributed's)")
split.main(only="rl")
