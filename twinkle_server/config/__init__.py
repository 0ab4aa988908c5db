"""What to serve and where: read and checked before anything loads.

- `flags`: `ServerConfig`, the server's one typed configuration, whose field descriptions
  produce `--help` (`add_arguments`, `from_args`; every field also from `TWINKLE_<FIELD>`);
- `model_table`: the served models, one `ModelConfig` each (`--models FILE`, or the
  `--model` shorthand): names, path, role (`TRAIN` or `SAMPLE`), placement and limits;
- `placement`: which devices or ranks hold which model (`place` over `Demand`s), a pure
  decision made once at start.

A declaration that cannot work is refused here, naming the table, the key and the limit,
before any weight is read. Others import `ServerConfig` from `flags`, `ModelConfig` and
the roles from `model_table`, and `place` from `placement`. This wing imports only the
engine's values, errors and tiny-model names, never torch: any layer may stand on it.
"""
