"""Order and batching of ops: it sees one `EngineAPI` and knows no tenant.

- `planning`: `Op`, the unit of work, and the pure decisions which ready ops share a
  pass (`plan_batch`), whether a training batch or a decode slice runs next
  (`plan_work`) and what a cancel does (`plan_cancel`); `default_token_budget`;
- `scheduler`: `Scheduler`, per-queue `seq_id` order, idempotent retries and the worker
  that runs the planned batches and decode slices;
- `executor`: `EngineExecutor`, which turns a batch of ops into engine calls, and the
  merge groups `FORWARD` and `SAMPLE`; `Turns`, a device shared by several models.

The runtime builds ops and submits them; it imports `Op`, `Scheduler`, `EngineExecutor`,
`Turns`, `FORWARD`, `SAMPLE` and `default_token_budget` from here. This wing imports the
engine's public modules and nothing above them; `scheduler` and `planning` import
neither torch nor grpc.
"""
