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

On several ranks (`parallel` given) each rank runs only its share of the datums through
the base and receives the others' logprobs; losses are then computed the same way on
every rank, and the pass's gradients summed over the ranks (`engine.parallel`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from twinkle_server.engine import logprobs, losses, packing
from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.base_model import BaseModel
from twinkle_server.engine.errors import EngineError, InvalidArgument
from twinkle_server.engine.lora import Router
from twinkle_server.engine.packing import PassLayout
from twinkle_server.engine.parallel import Parallel
from twinkle_server.engine.types import Datum, ForwardOutput, ForwardRequest

Row = tuple[ForwardRequest, Datum]


def adapter_order(requests: Sequence[ForwardRequest]) -> list[int]:
    """Request indices grouped by adapter (stable, by first appearance): the router needs
    each adapter's rows contiguous, and a single-adapter batch becomes one fast segment."""
    first_seen: dict[str, int] = {}
    for request in requests:
        first_seen.setdefault(request.adapter_id, len(first_seen))
    return sorted(range(len(requests)), key=lambda i: first_seen[requests[i].adapter_id])


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


def _pass_logprobs(base: BaseModel, router: Router, rows: list[Row], packed: bool,
                   parallel: Parallel | None
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], torch.Tensor | None]:
    """`_row_logprobs` of every row of the pass, and on several ranks an anchor: a zero
    that depends on this rank's own graph, for its backward to reach every layer even when
    none of the losses it backpropagates depends on its rows (None on one rank)."""
    grad = any(r.backward for r, _ in rows)
    if parallel is None:
        return (*_row_logprobs(base, router, rows, _hidden(base, router, rows, packed, grad),
                               grad), None)
    mine = parallel.share([d.num_tokens for _, d in rows])
    # A rank with no datum still takes part in every layer's collectives: one token under
    # the adapter of a backpropagated request (so its graph reaches that adapter), no
    # dropout, its loss never used.
    own = [rows[i] for i in mine] or [_filler(rows)]

    def compute() -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        lps, hits = _row_logprobs(base, router, own, _hidden(base, router, own, packed, grad),
                                  grad)
        # Not views: FSDP hooks the root's outputs for backward, and warns on views.
        return [lp.clone() for lp in lps], hits

    local_lps, local_hits = parallel.run(compute, backward=grad)
    anchor = torch.stack([lp.sum() for lp in local_lps]).sum() * 0.0
    if not mine:
        local_lps, local_hits = [], []
    targets = [d.loss_inputs["target_tokens"] for _, d in rows]
    lps = parallel.gather_rows(local_lps, [torch.Size(t.shape) for t in targets], mine)
    hits = parallel.gather_rows(
        [h if h is not None else torch.zeros(lp.shape[0], device=lp.device)
         for h, lp in zip(local_hits, local_lps, strict=True)],
        [torch.Size(t.shape[:1]) for t in targets], mine)
    return lps, [h if t.ndim == 1 else None for h, t in zip(hits, targets, strict=True)], anchor


def _filler(rows: list[Row]) -> Row:
    """One token of id 0 under the first backpropagated request's adapter (else the
    first request's), forward only."""
    request = next((r for r, _ in rows if r.backward), rows[0][0])
    zero = np.zeros(1, dtype=np.int64)
    datum = Datum(zero, {"target_tokens": zero})
    return ForwardRequest(request.adapter_id, [datum], None, False), datum


def run_forward(base: BaseModel, router: Router, adapters: Mapping[str, Adapter],
                requests: Sequence[ForwardRequest], packed: bool = True,
                parallel: Parallel | None = None) -> list[ForwardOutput | EngineError]:
    """Run validated requests in ONE base-model pass; results in the order of `requests`.
    `packed` False pads every datum to the longest instead (`--packing off`); `parallel`
    runs the pass on several ranks (see the module docstring).

    A request whose loss is not finite gets an `InvalidArgument` value and its gradient
    is discarded; the others' losses are backpropagated together and their adapters'
    counters and running metrics updated.
    """
    results: list[ForwardOutput | EngineError | None] = [None] * len(requests)
    slots = adapter_order(requests)
    grouped = [requests[i] for i in slots]
    rows = [(r, d) for r in grouped for d in r.datums]
    device = base.device
    row_lps, row_hits, anchor = _pass_logprobs(base, router, rows, packed, parallel)
    row = 0
    to_backward: list[torch.Tensor] = []
    for request, slot in zip(grouped, slots, strict=True):
        adapter = adapters[request.adapter_id]
        loss_spec = request.loss or adapter.loss
        lps, inputs = [], []
        correct = 0.0
        for datum in request.datums:
            tensors = {k: torch.tensor(np.asarray(v)).to(device)
                       for k, v in datum.loss_inputs.items()}
            lp, hit = row_lps[row], row_hits[row]
            if hit is not None:
                weights = tensors.get("weights")
                correct += float((hit * (weights != 0) if weights is not None else hit).sum())
            lps.append(lp)
            inputs.append(tensors)
            row += 1
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
            results[slot] = InvalidArgument(
                f"loss: {loss_spec.name} is not finite ({float(loss.detach())}); this "
                "batch's gradient was discarded and the adapter is unchanged")
            continue
        if request.backward:
            to_backward.append(loss)
            adapter.tokens_seen += sum(d.num_tokens for d in request.datums)
        book = adapter.train_metrics if request.backward else adapter.eval_metrics
        reported = float(loss.detach()) * divisor
        book.add(reported, correct, metrics["tokens:sum"])
        results[slot] = ForwardOutput(
            logprobs=[lp.detach().float().cpu().numpy() for lp in lps],
            loss=reported, metrics=metrics)
    if to_backward:
        _backward(adapters, to_backward if anchor is None else [*to_backward, anchor],
                  requests, results, parallel)
    elif parallel is not None and any(r.backward for r in requests):
        parallel.end_pass()
    return results  # type: ignore[return-value]


def _backward(adapters: Mapping[str, Adapter], to_backward: list[torch.Tensor],
              requests: Sequence[ForwardRequest], results: list,
              parallel: Parallel | None = None) -> None:
    """Backpropagate the kept losses; adapters not trained by them keep their grads.

    Autograd also reaches adapters in the batch whose loss is not backpropagated
    (forward-only, or discarded as non-finite): their rows add zeros, or NaN when
    their own logits are NaN (0 * NaN in the fused cross-entropy backward). Their
    gradients are saved before and put back after, bit for bit.

    On several ranks the trained adapters' gradients from this pass alone are summed over
    the ranks, then added to what they held before.
    """
    trained = {r.adapter_id for r, result in zip(requests, results, strict=True)
               if r.backward and isinstance(result, ForwardOutput)}
    kept = [(p, None if p.grad is None else p.grad.clone())
            for a in {r.adapter_id for r in requests} - trained
            for p in adapters[a].parameters()]
    if parallel is None:
        torch.stack(to_backward).sum().backward()
    else:
        params = [p for a in sorted(trained) for p in adapters[a].parameters()]
        before = [p.grad for p in params]
        for param in params:
            param.grad = None
        torch.stack(to_backward).sum().backward()
        parallel.end_pass()
        parallel.all_reduce_grads(params)
        for param, grad in zip(params, before, strict=True):
            if grad is not None:
                param.grad = grad + param.grad
    for param, grad in kept:
        param.grad = grad
