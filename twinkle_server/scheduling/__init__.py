"""Order and batching of ops: it sees one `EngineAPI` and knows no tenant.

- `planning`: `Op`, the unit of work, and the pure decisions which ready ops share a
  pass (`plan_batch`, within the engine's adapter `Slots`), whether a training batch or a decode slice runs next
  (`plan_work`) and what a cancel does (`plan_cancel`); `default_token_budget`;
- `queues`: each model's or sampling session's queue: `seq_id` order, idempotent
  retries, arrival order, and the refusals (`OutOfOrder`, `UnknownQueue`,
  `SchedulerClosed`);
- `decode_lane`: sample ops between their queue and the executor's decode pool;
- `answers`: how an op's future is answered: a batch's results one per op, failures,
  partial results, cancellations;
- `scheduler`: `Scheduler`, the lock and the worker that runs the planned batches and
  decode slices over the queues and the lane, and its drain on `stop`;
- `executor`: `EngineExecutor`, which turns a batch of ops into engine calls, and the
  merge groups `FORWARD` and `SAMPLE`; `Turns`, a device shared by several models.

The runtime builds ops and submits them; it imports `Op` and `default_token_budget`
(`planning`, with `Slots`), `Scheduler`, and `EngineExecutor`, `Turns`, `FORWARD`, `SAMPLE`
(`executor`) from here. This wing imports the engine's public modules and nothing above
them; `planning`, `queues`, `decode_lane`, `answers` and `scheduler` import neither
torch nor grpc.
"""
