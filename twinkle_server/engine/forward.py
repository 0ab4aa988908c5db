"""The merged forward pass: many requests of many adapters in one base-model pass.

Rows (datums) are grouped by adapter (the router needs each adapter's rows contiguous),
packed one after another into one sequence (position ids restarting and attention confined
to each datum: `engine.packing`; `--packing off` pads them to the longest instead), and
run once through the base model's decoder with each adapter's LoRA on its own tokens.
Target log-probabilities come from the last hidden states of the real positions, through
the output layer a chunk of tokens at a time (`engine.logprobs`: no `[tokens x vocab]`
logits for the whole pass); each request's loss is then computed on its own rows, and the
kept losses are backpropagated together. Requests reach `run_forward` already validated
(`Engine.validate_forward`).

On several ranks (`parallel`) each rank runs only its share of the datums through the
base and receives the others' logprobs; losses are then computed the same way on every
rank, and the pass's gradients summed over the ranks (`engine.parallel`). One process
alone runs the same code with the trivial `OneRank`, whose collectives are the identity.

`run_forward` is the whole training pass, top to bottom: rows grouped by adapter, their
logprobs through the base (`PassLogprobs.forward`), each request's loss
(`_request_loss`), the kept losses' backward (`_backward`), then the adapters' counters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from twinkle_server.engine import logprobs, losses, packing
from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.base_model import BaseModel
from twinkle_server.engine.errors import EngineError, InvalidArgument
from twinkle_server.engine.lora import Router, adapter_order
from twinkle_server.engine.packing import PassLayout
from twinkle_server.engine.parallel import OneRank, Parallel, share_of
from twinkle_server.engine.types import Datum, ForwardOutput, ForwardRequest

Row = tuple[ForwardRequest, Datum]


def _hidden(base: BaseModel, router: Router, rows: list[Row], packed: bool, grad: bool
            ) -> torch.Tensor:
    """Last hidden states `[positions, hidden]` of every real position of one pass,
    rows one after another (`datum.num_tokens` each): `PassLayout.row_tokens`' layout.

    Packed (the default): the rows in one sequence, position ids restarting and attention
    confined to each row, each adapter's rows one token segment (`engine.packing`). Not
    packed: right-padded rows (`--packing off`, the benchmark's baseline).
    """
    layout = PassLayout(tuple(d.num_tokens for _, d in rows), packed)
    inputs = layout.model_inputs(base, [d.input_ids for _, d in rows])
    route = layout.route(router, [r.adapter_id for r, _ in rows], [r.backward for r, _ in rows])
    with torch.set_grad_enabled(grad), route, packing.attention(base.model, layout):
        hidden = base.hidden_states(**inputs, use_cache=False)
    return layout.row_tokens(hidden)


def _row_logprobs(base: BaseModel, router: Router, rows: list[Row], hidden: torch.Tensor,
                  grad: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Each row's target logprobs (the shape of its `target_tokens`) and, for rows with
    `[T]` targets, its top-1 hits (1.0 where the target is the argmax of the logits).

    `hidden` is `_hidden`'s `[positions, hidden]`. The rows with `[T]` targets run as
    one chunked cross-entropy over all their positions; a row with `[T, K]` targets runs
    alone. A row's positions use its request's adapter, with dropout when it trains.
    """
    device = hidden.device
    head = logprobs.OutputHead.of(base.model, router)
    lengths = [d.num_tokens for _, d in rows]
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    targets = [torch.tensor(np.asarray(d.loss_inputs["target_tokens"])) for _, d in rows]
    simple = [t.ndim == 1 for t in targets]
    spans = [(r.adapter_id, r.backward, n) for (r, _), n in zip(rows, lengths, strict=True)]
    row_lps: list[torch.Tensor] = [None] * len(rows)  # type: ignore[list-item]
    row_hits: list[torch.Tensor | None] = [None] * len(rows)
    with torch.set_grad_enabled(grad):
        picked = [i for i, ok in enumerate(simple) if ok]
        if picked:
            flat = hidden if len(picked) == len(rows) else torch.cat(
                [hidden[starts[i]:starts[i + 1]] for i in picked])
            lp, hits = logprobs.target_logprobs(
                head, flat, torch.cat([targets[i] for i in picked]).to(device),
                logprobs.token_segments([spans[i] for i in picked]), hits=True)
            for i, piece, hit in zip(picked, lp.split([lengths[i] for i in picked]),
                                     hits.split([lengths[i] for i in picked]), strict=True):
                row_lps[i], row_hits[i] = piece, hit
        for i in (i for i, ok in enumerate(simple) if not ok):
            row_lps[i], _ = logprobs.target_logprobs(
                head, hidden[starts[i]:starts[i + 1]], targets[i].to(device),
                logprobs.token_segments([spans[i]]))
    return row_lps, row_hits


def pieces(lengths: Sequence[int], cap: int) -> list[range]:
    """Consecutive runs of rows, each of at most `cap` tokens (a longer row alone); one
    run of every row when `cap` is 0 (no cap)."""
    runs: list[range] = []
    start, total = 0, 0
    for index, n in enumerate(lengths):
        if cap and total and total + n > cap:
            runs.append(range(start, index))
            start, total = index, 0
        total += n
    return [*runs, range(start, len(lengths))] if lengths else []


class PassLogprobs:
    """Every row's target logprobs (and top-1 hits) of one pass, and the backward into
    them: the part of a merged pass that touches the base. Building one plans the pass
    (this rank's rows, in pieces) and runs nothing; `forward` runs it, then `backward`
    (or `drop`, when no loss is kept) ends it.

    Rows run through the base in pieces of at most `cap` tokens (`EngineLimits.
    max_pass_tokens`), so a pass's activation memory is bounded whatever the requests'
    size. One piece runs as it always has: its logprobs carry the graph, and `backward`
    backpropagates the losses through it. Several run twice: first without grad, for
    the values the losses need; then `backward` takes the losses' gradients with respect
    to the logprobs (leaf tensors) and replays the pieces one at a time with grad, each
    backpropagating its share (dropout replays the same masks). Every loss, metric and
    gradient comes out as from one pass, to float rounding, for one more forward.

    On several ranks (`parallel`) each rank runs only its share of the rows
    (`Parallel.share`), in as many pieces as the rank that needs most (a rank out of
    rows runs a filler token), and receives the others' logprobs; backward then sums
    nothing itself: `_backward` all-reduces the adapters' gradients. On one rank
    (`OneRank`) the share is every row and the gathers return what they are given.
    """

    def __init__(self, base: BaseModel, router: Router, rows: list[Row], packed: bool,
                 parallel: Parallel, cap: int) -> None:
        self.base, self.router, self.rows, self.packed = base, router, rows, packed
        self.parallel = parallel
        self.grad = any(r.backward for r, _ in rows)
        lengths = [d.num_tokens for _, d in rows]
        self.mine = parallel.share(lengths)
        own = [rows[i] for i in self.mine]
        self.pieces = [[own[i] for i in run]
                       for run in pieces([d.num_tokens for _, d in own], cap)]
        self.real = len(self.pieces)
        count = max(len(pieces([lengths[i] for i in share_of(lengths, r, parallel.world)],
                               cap))
                    for r in range(parallel.world))
        # A rank out of rows still takes part in every layer's collectives: one token
        # under the adapter of a backpropagated request (so its graph reaches that
        # adapter), no dropout, its loss never used.
        self.pieces += [[_filler(rows)] for _ in range(count - self.real)]
        self.rng: list[tuple[torch.Tensor, ...]] = []  # per piece, when replayed
        self.leaves: list[torch.Tensor] | None = None  # the logprobs replays backprop into
        self.anchor: torch.Tensor | float = 0.0        # `Parallel.anchor`, one piece

    def forward(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Every row's target logprobs (the shape of its `target_tokens`) and top-1 hits
        (None for `[T, K]` targets), in the order of `rows`."""
        replayed = len(self.pieces) > 1
        local_lps: list[torch.Tensor] = []
        local_hits: list[torch.Tensor | None] = []
        for index, piece in enumerate(self.pieces):
            if replayed:
                self.rng.append(_rng_state(self.base.device))
                with torch.no_grad():
                    lps, hits = self._run(piece, grad=False)
            else:
                lps, hits = self._run(piece, grad=self.grad)
                self.anchor = self.parallel.anchor(lps)
            if index < self.real:
                local_lps += lps
                local_hits += hits
        if replayed:
            local_lps = [lp.detach().requires_grad_(self.grad) for lp in local_lps]
            self.leaves = local_lps
        targets = [d.loss_inputs["target_tokens"] for _, d in self.rows]
        lps = self.parallel.gather_rows(local_lps, [torch.Size(t.shape) for t in targets],
                                        self.mine)
        hits = self.parallel.gather_rows(
            [h if h is not None else torch.zeros(lp.shape[0], device=lp.device)
             for h, lp in zip(local_hits, local_lps, strict=True)],
            [torch.Size(t.shape[:1]) for t in targets], self.mine)
        return lps, [h if t.ndim == 1 else None for h, t in zip(hits, targets, strict=True)]

    def _run(self, rows: list[Row], grad: bool
             ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        def compute() -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
            lps, hits = _row_logprobs(
                self.base, self.router, rows,
                _hidden(self.base, self.router, rows, self.packed, grad), grad)
            # Not views: FSDP hooks the root's outputs for backward, and warns on views.
            return [lp.clone() for lp in lps], hits

        return self.parallel.run(compute, backward=grad)

    def backward(self, kept: list[torch.Tensor]) -> None:
        """Backpropagate the sum of `kept` (losses of `forward`'s logprobs) into the
        adapters."""
        total = torch.stack(kept).sum()
        if self.leaves is None:
            (total + self.anchor).backward()
            self.parallel.end_pass()
            return
        # On several ranks, a rank whose own rows no kept loss uses has nothing to
        # backpropagate here, but still replays its pieces: their collectives are everyone's.
        if total.requires_grad:
            total.backward()
        grads = iter(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                     for leaf in self.leaves)
        device = self.base.device
        for index, (piece, state) in enumerate(zip(self.pieces, self.rng, strict=True)):
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                _set_rng_state(device, state)
                lps, _ = self._run(piece, grad=True)
            outs = [(lp * (next(grads) if index < self.real else 0.0)).sum() for lp in lps]
            torch.stack(outs).sum().backward()
            self.parallel.end_pass()

    def drop(self) -> None:
        """No loss of the pass is backpropagated: release what a backward would have."""
        if self.grad and self.leaves is None:
            self.parallel.end_pass()


def _rng_state(device: torch.device) -> tuple[torch.Tensor, ...]:
    """The generators LoRA dropout draws from: the CPU's, and the device's on CUDA."""
    if device.type == "cuda":
        return torch.get_rng_state(), torch.cuda.get_rng_state(device)
    return (torch.get_rng_state(),)


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, ...]) -> None:
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)


def _filler(rows: list[Row]) -> Row:
    """One token of id 0 under the first backpropagated request's adapter (else the
    first request's), forward only."""
    request = next((r for r, _ in rows if r.backward), rows[0][0])
    zero = np.zeros(1, dtype=np.int64)
    datum = Datum(zero, {"target_tokens": zero})
    return ForwardRequest(request.adapter_id, [datum], None, False), datum


def run_forward(base: BaseModel, router: Router, adapters: Mapping[str, Adapter],
                requests: Sequence[ForwardRequest], packed: bool = True,
                parallel: Parallel | None = None, max_pass_tokens: int = 0
                ) -> list[ForwardOutput | EngineError]:
    """Run validated requests in ONE base-model pass; results in the order of `requests`.
    `packed` False pads every datum to the longest instead (`--packing off`); `parallel`
    runs the pass on several ranks (see the module docstring; None: this process alone);
    `max_pass_tokens` (0: no cap) splits it into pieces that each run through the base
    alone (`PassLogprobs`).

    A request whose loss is not finite gets an `InvalidArgument` value and its gradient
    is discarded; the others' losses are backpropagated together and their adapters'
    counters and running metrics updated.
    """
    parallel = parallel if parallel is not None else OneRank(base.device)
    # 1. Rows grouped by adapter (the router needs each adapter's rows contiguous).
    slots = adapter_order([r.adapter_id for r in requests])
    grouped = [requests[i] for i in slots]
    rows = [(r, d) for r in grouped for d in r.datums]
    # 2. Every row's target logprobs, through the base.
    computed = PassLogprobs(base, router, rows, packed, parallel, max_pass_tokens)
    row_lps, row_hits = computed.forward()
    # 3. Each request's loss on its own rows; a non-finite one is that request's error.
    results: list[ForwardOutput | EngineError | None] = [None] * len(requests)
    to_backward: list[torch.Tensor] = []
    counters: list[tuple[int, Adapter, ForwardRequest, float, float, float]] = []
    row = 0
    for request, slot in zip(grouped, slots, strict=True):
        adapter = adapters[request.adapter_id]
        count = len(request.datums)
        outcome = _request_loss(adapter, request, row_lps[row:row + count],
                                row_hits[row:row + count], base.device)
        row += count
        if isinstance(outcome, EngineError):
            results[slot] = outcome
            continue
        loss, output, correct = outcome
        if request.backward:
            to_backward.append(loss)
        counters.append((slot, adapter, request, output.loss, correct,
                         output.metrics["tokens:sum"]))
        results[slot] = output
    # 4. The kept losses backpropagated together (gradients summed over the ranks).
    if to_backward:
        _backward(adapters, computed, to_backward, requests, results, parallel)
    else:
        computed.drop()
    # 5. Counted once the pass has gone through: a backward that fails leaves them as well,
    # and so does a request whose gradient `_backward` refused.
    for slot, adapter, request, reported, correct, tokens in counters:
        if isinstance(results[slot], EngineError):
            continue
        if request.backward:
            adapter.tokens_seen += sum(d.num_tokens for d in request.datums)
        book = adapter.train_metrics if request.backward else adapter.eval_metrics
        book.add(reported, correct, tokens)
    return results  # type: ignore[return-value]


def _request_loss(adapter: Adapter, request: ForwardRequest, lps: list[torch.Tensor],
                  hits: list[torch.Tensor | None], device: torch.device
                  ) -> tuple[torch.Tensor, ForwardOutput, float] | InvalidArgument:
    """One request's loss over its rows' logprobs `lps`: (the loss to backpropagate, its
    output, its count of correct top-1 predictions), or the error when it is not finite."""
    loss_spec = request.loss or adapter.loss
    inputs = []
    correct = 0.0
    for datum, hit in zip(request.datums, hits, strict=True):
        tensors = {k: torch.tensor(np.asarray(v)).to(device)
                   for k, v in datum.loss_inputs.items()}
        if hit is not None:
            weights = tensors.get("weights")
            correct += float((hit * (weights != 0) if weights is not None else hit).sum())
        inputs.append(tensors)
    # Native losses divide a training micro-batch by the accumulation count so the
    # window's gradients add up to one big batch's; an eval pass is not divided, and
    # the loss reported (output, metrics, calculate_metric) is the batch's own mean.
    native = losses.LOSSES[loss_spec.name].native
    divisor = adapter.grad_accum if native and request.backward else 1
    loss, metrics = losses.compute_loss(loss_spec, lps, inputs, divisor)
    if divisor != 1:
        metrics = {k: v * divisor if k.startswith("loss:") else v
                   for k, v in metrics.items()}
    if not torch.isfinite(loss):
        return InvalidArgument(
            f"loss: {loss_spec.name} is not finite ({float(loss.detach())}); this "
            "batch's gradient was discarded and the adapter is unchanged")
    output = ForwardOutput(logprobs=[lp.detach().float().cpu().numpy() for lp in lps],
                           loss=float(loss.detach()) * divisor, metrics=metrics)
    return loss, output, correct


def _backward(adapters: Mapping[str, Adapter], computed: PassLogprobs,
              to_backward: list[torch.Tensor], requests: Sequence[ForwardRequest],
              results: list, parallel: Parallel) -> None:
    """Backpropagate the kept losses; adapters not trained by them keep their grads.

    Autograd also reaches adapters in the batch whose loss is not backpropagated
    (forward-only, or discarded as non-finite): their rows add zeros, or NaN when
    their own logits are NaN (0 * NaN in the fused cross-entropy backward). Their
    gradients are saved before and put back after, bit for bit.

    The trained adapters' gradients of this pass are computed apart, then added to what
    they held before (on several ranks, after summing them over the ranks), so a backward
    that fails part-way (out of memory in its third piece, say) leaves every adapter's
    gradients as they were. An adapter whose gradients of this pass are not finite (a
    finite loss can have them: a ratio `exp(logp - old)` overflowing to infinity on a
    clipped branch backpropagates 0 x inf) keeps what it held, and its requests become
    `InvalidArgument`s in `results`.
    """
    trained = {r.adapter_id for r, result in zip(requests, results, strict=True)
               if r.backward and isinstance(result, ForwardOutput)}
    kept = [(p, None if p.grad is None else p.grad.clone())
            for a in {r.adapter_id for r in requests} - trained
            for p in adapters[a].parameters()]
    owned = [(a, p) for a in sorted(trained) for p in adapters[a].parameters()]
    params = [p for _, p in owned]
    before = [p.grad for p in params]
    for param in params:
        param.grad = None
    try:
        computed.backward(to_backward)
        parallel.all_reduce_grads(params)
    except BaseException:
        for param, grad in zip(params, before, strict=True):
            param.grad = grad
        raise
    finally:
        for param, grad in kept:
            param.grad = grad
    refused = {a for a in trained if not _finite(adapters[a].parameters())}
    for (owner, param), grad in zip(owned, before, strict=True):
        if owner in refused:
            param.grad = grad
        elif grad is not None and param.grad is not None:
            param.grad.add_(grad)  # this pass's fresh tensor: nothing to allocate
        elif grad is not None:
            param.grad = grad
    for index, request in enumerate(requests):
        if request.adapter_id in refused and request.backward:
            loss = (request.loss or adapters[request.adapter_id].loss).name
            results[index] = InvalidArgument(
                f"loss: the gradient of {loss} is not finite though the loss is (a ratio "
                "exp(logp - logprobs) past the float range, say: the datums' 'logprobs' "
                "far below the model's); this batch's gradient was discarded and the "
                "adapter is unchanged")


def _finite(params: Iterator[torch.nn.Parameter]) -> bool:
    """Whether every gradient the parameters hold is finite (one device sync)."""
    flags = [torch.isfinite(p.grad).all() for p in params if p.grad is not None]
    return bool(torch.stack(flags).all()) if flags else True
