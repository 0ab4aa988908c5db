"""The Twinkle server: base models served to many tenants' LoRA adapters, over gRPC and HTTP.

Where each job lives:

- `engine/`: one frozen base model and many LoRA adapters, pure torch, no network: the
  multi-LoRA layers, merged training passes, losses, optimizers, PEFT checkpoints,
  prompt scoring, batch-invariant sampling forwards (`batch_invariant`, every row as
  alone: `--batch-invariant on`); `Engine` its entry (its training verbs in `training`),
  `protocol.EngineAPI` how the rest of the server sees it. A failed request comes back
  as an `EngineError` value, so one tenant's bad request never stops another's.
- `engine/sampling/`: the engine's decode wing: the continuous-batching pool (admission,
  prefix cache, KV batch, one token step, the pool's request books, its loop and its
  fault rules), the static batch it is measured against, and `verbs`, the sampling half
  `Engine` composes.
- `scheduling/`: order and batching, knowing no tenant: per-queue `seq_id` order and
  idempotent retries (`queues`), which ready ops share a pass and when a decode slice
  runs (`planning`, pure), sample ops on their way to the decode pool (`decode_lane`),
  the worker and its drain (`scheduler`), and the executor that turns a batch into
  calls on one `EngineAPI` (`executor`).
- `ranks/`: one `EngineAPI` over several processes, knowing no tenant, queue or wire:
  the launch under torchrun, the channel between ranks, replication (rank 0's calls
  replayed on every rank), a model split into trainer and sampler ranks, and the
  sampler ranks with rank 0's links to them.
- `config/`: what to serve and where, read and checked before anything loads: the flags
  (`ServerConfig`), the served-models table, placement.
- `store/`: the SQLite registry, one module per table: API keys, sessions, runs,
  checkpoints, stability records, the audit log.
- `runtime/`: tenants and ownership (`core`), op construction, refusals and the typed
  verbs (training, sampling, runs, external weights, imports, copies) over plain values
  (`values`); the served models (`bases`), each with its own engine, scheduler and
  decode pool. No grpc.
- `service/`: the gRPC front: one servicer per service, proto -> verb -> proto, and the
  one map from error categories to status codes.
- `http/`: the HTTP front: the Tinker REST API (the stock `tinker` SDK: the shared
  front, service and future routes in `app`, models and training ops in `training`,
  sampling in `sampling`, listings in `rest`), the OpenAI-compatible routes (`oai`),
  `/metrics`, health, and the signed URLs of external weights and adapter uploads; the
  same verbs, errors mapped to HTTP statuses.
- `cli.py`: `twinkle-server`: serve (handing itself to torchrun for several ranks), API
  keys, runs, adapter import.
- `server.py`: the assembly: engines (over `ranks` when several processes serve), the
  runtime, grpc.aio with health and reflection, and the HTTP front as a task on the same
  event loop; draining on shutdown.
- `process.py`: start and stop a local server process, for the demo, tests and benches.

The imports go one way (an arrow: "imports"):

    service/, http/ --> runtime/ --> scheduling/ --> engine/ (and its sampling/)
                           |
                           +--> store/
    ranks/ --> engine/, config/
    config/ --> engine/ (its values, errors and tiny-model names)
    cli.py, server.py --> any of them;  process.py --> service/

- The fronts also read the store's rows, the flags and (for `/metrics`) `scheduling`'s
  `Op`; the runtime reads `config`. Nothing in `config/` loads a model.
- The runtime, the fronts and `scheduling` reach the engine only through its public
  modules (`engine.PUBLIC_MODULES`); `ranks` builds engines and may use any of it.
- Nobody but the entry and the assembly imports `ranks/`: the rest sees the engine it
  builds as an `EngineAPI`. `scheduling` imports neither the runtime nor a front.
- `engine/` and `store/` import nothing else of the server, and the server imports
  nothing of its clients: it stands on the contract, `twinkle_wire`.

`tests/wire/test_wings.py` holds these arrows; `tests/` mirrors the packages.
"""
