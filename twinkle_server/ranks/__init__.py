"""One engine over several processes: it builds an `EngineAPI` from ranks and knows no
tenant, queue or wire.

- `launch`: `twinkle-server serve --nproc-per-node N` under torch's elastic launcher; each
  rank joins the group, loads its engines (`load_engine`) and rank 0 serves while the
  others follow;
- `channel`: calls between ranks over a gloo group (a pickled header, its arrays as one
  tensor), every collective bounded by the group's timeout;
- `replication`: `ReplicatedEngine`, rank 0's engine of a model on several ranks, which
  sends every `@replicated` call to the others (`follow`) before running it itself;
- `split`: `SplitEngine`, rank 0's engine of a model split into trainer ranks and sampler
  ranks (`sampler_ranks = K`), trained weights published to the samplers in memory;
- `sampler_rank`: what a sampler rank runs (`SamplerRank`) and what it is sent;
- `sampler_links`: rank 0's ends of the sampler ranks' channels;
- `reads`: what rank 0's engine answers alone (reads, request checks, state saves), the
  part `ReplicatedEngine` and `SplitEngine` share.

Only the entry and the assembly (`cli.py`, `server.py`) import this wing, for
`launch`, `ReplicatedEngine`, `SplitEngine` and `Channel`; the runtime, the scheduler
and the fronts see the engine it builds only as an `EngineAPI`. It imports the engine and
`config`, nothing above them.
"""
