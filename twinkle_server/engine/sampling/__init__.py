"""Sampling, one job a module:

- `admission`: which waiting requests join the decode pool, within its KV bound (pure);
- `prefix_cache`: a session's earlier prompts' KV, reused by prompts that extend them;
- `kv_batch`: the decoding rows' left-padded KV cache, its buffers and their used width;
- `tokens`: the one token step (pick, logprob, top-k, stop rule, non-finite logits);
- `decode_attention`: a decode step's attention, a group's shared prompt read once;
- `book`: the decode pool's request records and their admission bookkeeping (`PoolStats`);
- `pool`: the decode pool's loop (continuous batching) and its fault rules;
- `static`: the static batch, the baseline the pool is measured against;
- `verbs`: the engine's sampling half (`Sampling`), which the engine composes.

The arrows point one way: `verbs -> pool -> book -> (admission, prefix_cache, kv_batch, tokens)`,
`static -> tokens`; with `--batch-invariant on` the pool's and the static batch's forwards
run in `engine.batch_invariant`'s mode instead. Nothing here imports `engine.engine`.
"""
