"""The merged forward pass: many requests of many adapters in one base-model pass.

Rows are grouped by adapter (the router needs each adapter's rows contiguous), padded to
the longest row, and run once through the base model with per-row LoRA routing. Target
log-probabilities come from one fused cross-entropy over every real position; each
request's loss is then computed on its own rows, and the kept losses are backpropagated
together. Requests reach `run_forward` already validated (`Engine.validate_forward`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch.nn import functional as F

from twinkle_server.engine import losses
from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.base_model import BaseModel
from twinkle_server.engine.errors import EngineError, InvalidArgument
from twinkle_server.engine.lora import Router
from twinkle_server.engine.types import Datum, ForwardOutput, ForwardRequest

Row = tuple[ForwardRequest, Datum]


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position: `[T]` targets give `[T]`, `[T, K]` give `[T, K]`."""
    logits, targets = logits.float(), targets.long()
    if targets.ndim == 1:
        return -F.cross_entropy(logits, targets, reduction="none")
    return torch.log_softmax(logits, dim=-1).gather(-1, targets)


def adapter_order(requests: Sequence[ForwardRequest]) -> list[int]:
    """Request indices grouped by adapter (stable, by first appearance): the router needs
    each adapter's rows contiguous, and a single-adapter batch becomes one fast segment."""
    first_seen: dict[str, int] = {}
    for request in requests:
        first_seen.setdefault(request.adapter_id, len(first_seen))
    return sorted(range(len(requests)), key=lambda i: first_seen[requests[i].adapter_id])


def _logits(base: BaseModel, router: Router, rows: list[Row]
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits `[rows, width, vocab]` of one pass over the right-padded rows, and the
    attention mask it used (None when no row is padded)."""
    device = base.device
    lengths = [d.num_tokens for _, d in rows]
    width = max(lengths)
    ids = torch.full((len(rows), width), base.pad_token_id, dtype=torch.long)
    for row, (_, datum) in enumerate(rows):
        ids[row, :datum.num_tokens] = torch.tensor(np.asarray(datum.input_ids))
    # No mask when nothing is padded: the plain causal path is the fastest kernel.
    mask = None
    if min(lengths) != width:
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long().to(device)
    backward = any(r.backward for r, _ in rows)
    route = router.route([r.adapter_id for r, _ in rows], [r.backward for r, _ in rows])
    with torch.set_grad_enabled(backward), route:
        logits = base.model(input_ids=ids.to(device), attention_mask=mask,
                            use_cache=False).logits
    return logits, mask


def run_forward(base: BaseModel, router: Router, adapters: Mapping[str, Adapter],
                requests: Sequence[ForwardRequest]) -> list[ForwardOutput | EngineError]:
    """Run validated requests in ONE base-model pass; results in the order of `requests`.

    A request whose loss is not finite gets an `InvalidArgument` value and its gradient
    is discarded; the others' losses are backpropagated together and their adapters'
    counters and running metrics updated.
    """
    results: list[ForwardOutput | EngineError | None] = [None] * len(requests)
    slots = adapter_order(requests)
    grouped = [requests[i] for i in slots]
    rows = [(r, d) for r in grouped for d in r.datums]
    device = base.device
    lengths = [d.num_tokens for _, d in rows]
    width = max(lengths)
    logits, mask = _logits(base, router, rows)
    # One fused cross-entropy over the real (unpadded) positions of every row with
    # per-position targets, not one call per datum and nothing spent on padding.
    simple = [d.loss_inputs["target_tokens"].ndim == 1 for _, d in rows]
    if mask is None and all(simple):
        # Every position is real: no gather, whose copy and backward scatter of the
        # whole logits tensor cost more than the loss itself.
        flat_logits = logits.flatten(0, 1)
    else:
        real = torch.cat([row * width + torch.arange(n)
                          for row, n in enumerate(lengths) if simple[row]] or
                         [torch.zeros(0, dtype=torch.long)]).to(device)
        flat_logits = logits.flatten(0, 1)[real]
    flat_targets = torch.cat([torch.tensor(np.asarray(d.loss_inputs["target_tokens"]))
                              for (_, d), ok in zip(rows, simple, strict=True) if ok]
                             or [torch.zeros(0, dtype=torch.long)]).to(device)
    flat = target_logprobs(flat_logits, flat_targets)
    with torch.no_grad():
        hits = (flat_logits.argmax(-1) == flat_targets).float()
    row, offset = 0, 0
    to_backward: list[torch.Tensor] = []
    for request, slot in zip(grouped, slots, strict=True):
        adapter = adapters[request.adapter_id]
        loss_spec = request.loss or adapter.loss
        lps, inputs = [], []
        correct = 0.0
        for datum in request.datums:
            n = datum.num_tokens
            tensors = {k: torch.tensor(np.asarray(v)).to(device)
                       for k, v in datum.loss_inputs.items()}
            if simple[row]:
                lp, hit = flat[offset:offset + n], hits[offset:offset + n]
                offset += n
                weights = tensors.get("weights")
                correct += float((hit * (weights != 0) if weights is not None else hit).sum())
            else:
                lp = target_logprobs(logits[row, :n], tensors["target_tokens"])
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
        _backward(adapters, to_backward, requests, results)
    return results  # type: ignore[return-value]


def _backward(adapters: Mapping[str, Adapter], to_backward: list[torch.Tensor],
              requests: Sequence[ForwardRequest], results: list) -> None:
    """Backpropagate the kept losses; adapters not trained by them keep their grads.

    Autograd also reaches adapters in the batch whose loss is not backpropagated
    (forward-only, or discarded as non-finite): their rows add zeros, or NaN when
    their own logits are NaN (0 * NaN in the fused cross-entropy backward). Their
    gradients are saved before and put back after, bit for bit.
    """
    trained = {r.adapter_id for r, result in zip(requests, results, strict=True)
               if r.backward and isinstance(result, ForwardOutput)}
    kept = [(p, None if p.grad is None else p.grad.clone())
            for a in {r.adapter_id for r in requests} - trained
            for p in adapters[a].parameters()]
    torch.stack(to_backward).sum().backward()
    for param, grad in kept:
        param.grad = grad
