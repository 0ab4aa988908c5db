"""The contract's calls as plain Python: the one layer of the clients that builds and reads
protobuf messages.

`Connection` carries calls (channel, key, retries, seq_ids, the call pool); this package
turns plain values into requests and replies into frozen dataclasses (`values`) and numpy
arrays, one module per service of the contract (`training`, `sampling`, `runs`,
`session`, `external`) over the two kinds of request in `calls`.
`twinkle_client.client`, `twinkle_client.model` and `tinker_compat` call only this (and
`wire` for their datums); none of them imports `_proto` or reads a message. Everything
is reachable as `api.<name>`.

Every request is checked and built in the caller's thread and sent later, so an argument
the contract cannot carry raises where the call is written, before anything is sent:

- Unordered calls (models, sampling sessions and samples, runs, checkpoints) return a
  `Call`; `call.send(conn)` sends it and returns the reply as a plain value (the clients
  run `send` on the call pool with `conn.submit` when they return futures). Downloads
  and the cached server facts are plain functions of the connection.
- Ordered ops of a training model (`set_loss(...)`, `forward(datums, ...)`, `step()`, ...)
  return an `OpCall`, built before any seq_id is taken: a bad argument leaves no gap in
  the model's op order. `submit(conn, model_id, call)` then takes the model's next
  seq_id at once, in call order, and sends the op from the pool. A client that reserves
  seq_ids itself (`conn.reserve`) sends with `call.send(conn, op)` and spends a reserved
  one it will not use with `release(conn, op)`.

Example:
    info = api.create_model(base_model="tiny", lora=api.LoraSpec(8, all_linear=True)).send(conn)
    fwd = api.submit(conn, info.model_id, api.forward(datums, api.Loss("cross_entropy")))
    api.submit(conn, info.model_id, api.optim_step(api.AdamParams(1e-4, 0.9, 0.95, 1e-8)))
    print(fwd.result().metrics["loss:sum"])
"""

from twinkle_client.api.calls import Call, ForwardCall, OpCall, release, submit
from twinkle_client.api.external import (
    ExternalWeightsUrls,
    Upload,
    external_weights_urls,
    finish_upload,
    put_files,
    save_weights_external,
    start_upload,
)
from twinkle_client.api.runs import (
    copy_checkpoint,
    delete_checkpoint,
    download_checkpoint,
    get_audit_log,
    get_checkpoint,
    get_run,
    list_checkpoints,
    list_runs,
    publish_checkpoint,
    set_checkpoint_ttl,
    write_files,
)
from twinkle_client.api.sampling import (
    compute_logprobs,
    create_sampling_session,
    sample,
    sample_op,
)
from twinkle_client.api.session import capabilities, download_tokenizer, health_check
from twinkle_client.api.training import (
    calculate_metric,
    clip_grad_norm,
    create_model,
    forward,
    get_train_configs,
    load_state,
    lr_step,
    optim_step,
    save_ephemeral_sampler,
    save_state,
    save_weights_for_sampler,
    set_loss,
    set_lr_scheduler,
    set_optimizer,
    step,
    unload_model,
    zero_grad,
)
from twinkle_client.api.values import (
    AuditEntry,
    Capabilities,
    Checkpoint,
    Completion,
    ForwardResult,
    LoraSpec,
    Loss,
    ModelInfo,
    Page,
    SampleResult,
    SamplingSession,
    ServedModel,
    TrainingRun,
)
from twinkle_client.connection import Op
from twinkle_wire.values import AdamParams, SamplingParams, ServerLimits

__all__ = [
    "AuditEntry", "copy_checkpoint", "get_audit_log",
    "AdamParams", "Call", "Capabilities", "Checkpoint", "Completion", "ExternalWeightsUrls",
    "ForwardCall", "external_weights_urls", "save_weights_external",
    "Upload", "finish_upload", "put_files", "start_upload",
    "ForwardResult", "LoraSpec", "Loss", "ModelInfo", "Op", "OpCall", "Page", "SampleResult",
    "SamplingParams", "SamplingSession", "ServedModel", "ServerLimits", "TrainingRun",
    "calculate_metric", "capabilities", "clip_grad_norm", "compute_logprobs", "create_model",
    "create_sampling_session", "delete_checkpoint", "download_checkpoint",
    "download_tokenizer", "forward", "get_checkpoint", "get_run", "get_train_configs",
    "health_check", "list_checkpoints", "list_runs", "load_state", "lr_step", "optim_step",
    "publish_checkpoint", "release", "sample", "sample_op", "save_ephemeral_sampler",
    "save_state",
    "save_weights_for_sampler", "set_checkpoint_ttl", "set_loss",
    "set_lr_scheduler", "set_optimizer", "step", "submit", "unload_model", "write_files",
    "zero_grad",
]
