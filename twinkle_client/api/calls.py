"""Requests built now and sent later: `Call` (unordered) and `OpCall` (ordered ops).

A request is checked and built in the caller's thread, so an argument the contract cannot
carry raises where the call is written. An `OpCall` is built before its model's seq_id is
taken, so a refused argument leaves no gap in the model's op order; `submit` then takes
the seq_id in the caller's thread (call order is op order) and sends from the call pool,
or releases it if the op's future is cancelled before it is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import twinkle_wire as wire
from twinkle_client.api.values import ForwardResult, Loss
from twinkle_client.connection import Connection, Op
from twinkle_client.futures import Future
from twinkle_wire._proto.twinkle.v1 import common_pb2, training_pb2

log = logging.getLogger("twinkle_client")

T = TypeVar("T")


class Call(Generic[T]):
    """One unary request, checked and built; `send(conn)` sends it (blocking) and returns
    the reply read as a plain value. `retry=False` for calls that are not idempotent."""

    def __init__(self, service: str, method: str, request: Any, read: Callable[[Any], T],
                 *, retry: bool = True) -> None:
        self.method = method
        self.request = request
        self._service = service
        self._read = read
        self._retry = retry

    def send(self, conn: Connection) -> T:
        stub = getattr(getattr(conn, self._service), self.method)
        return self._read(conn.call(stub, self.request, retry=self._retry))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.method}>"


class InSession(Call[T]):
    """A call that belongs to the connection's session (its models and samplers are
    unloaded with it)."""

    def send(self, conn: Connection) -> T:
        self.request.session_id = conn.session_id or ""
        return super().send(conn)


def op_header(op: Op) -> common_pb2.OpHeader:
    """A reserved op as the wire's header."""
    return common_pb2.OpHeader(model_id=op.model_id, seq_id=op.seq_id,
                               request_id=op.request_id)


class OpCall(Generic[T]):
    """One op of a training model, checked and built but not yet numbered.

    `send(conn, op)` numbers it with a reserved `op`, sends it (blocking) and returns the
    reply as a plain value; an OpCall is sent once.
    """

    method: str

    def send(self, conn: Connection, op: Op) -> T:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.method}>"


class UnaryOp(OpCall[T]):
    """An ordered unary op: its request message, with `op` set when it is sent."""

    def __init__(self, service: str, method: str, request: Any,
                 read: Callable[[Any], T]) -> None:
        self.method = method
        self._call = Call(service, method, request, read)

    def send(self, conn: Connection, op: Op) -> T:
        self._call.request.op.CopyFrom(op_header(op))
        return self._call.send(conn)


class ForwardCall(OpCall[ForwardResult]):
    """A Forward (`backward=False`) or ForwardBackward op over datum chunks packed by
    `wire.pack_request`; `forward(datums, ...)` packs and builds one."""

    def __init__(self, chunks: Sequence[training_pb2.ForwardChunk], loss: Loss | None = None,
                 backward: bool = True) -> None:
        chunks = list(chunks)
        if not all(isinstance(c, training_pb2.ForwardChunk) and c.HasField("batch")
                   for c in chunks):
            raise TypeError("chunks: expected the ForwardChunk messages of "
                            "wire.pack_request(datums), packed before the op's seq_id is taken")
        self.method = "ForwardBackward" if backward else "Forward"
        self._chunks = chunks
        self._loss = loss_fn(loss)

    def send(self, conn: Connection, op: Op) -> ForwardResult:
        first = training_pb2.ForwardChunk(header=training_pb2.ForwardHeader(
            op=op_header(op), loss=self._loss,
            num_datums=sum([len(chunk.batch.lengths) for chunk in self._chunks])))
        replies = conn.call_stream(getattr(conn.training, self.method), [first, *self._chunks])
        outputs = [{key: wire.decode_array(tensor, f"outputs[{i}][{key!r}]")
                    for key, tensor in out.outputs.items()}
                   for i, out in enumerate(o for reply in replies for o in reply.outputs)]
        last = replies[-1]
        return ForwardResult(outputs, last.loss, dict(last.metrics))


def submit(conn: Connection, model_id: str, call: OpCall[T], *,
           future_class: type[Future] = Future) -> Future[T]:
    """Take `model_id`'s next seq_id now, in the caller's thread, and send `call` under it
    from the call pool; returns its future at once. Cancelled before it is sent, the op is
    never sent and its seq_id is released; once sent, it cannot be cancelled."""
    op = conn.reserve(model_id)
    return conn.submit(call.send, conn, op, future_class=future_class,
                       on_cancel=lambda: release(conn, op))


def release(conn: Connection, op: Op) -> None:
    """Spend reserved `op` with no op under it (SkipSeq), so the model's later ops do not
    wait for it. Failures are logged, not raised: the caller is already reporting why
    the real op was not sent."""
    try:
        conn.call(conn.training.SkipSeq, training_pb2.OpRequest(op=op_header(op)))
    except Exception as exc:  # noqa: BLE001 - logged; the caller's own error is raised
        log.warning("releasing seq %d of %s: %s", op.seq_id, op.model_id, exc)


def loss_fn(loss: Loss | None) -> common_pb2.LossFn:
    """A loss as the wire's LossFn; None is the empty one (the loss set with SetLoss)."""
    if loss is None:
        return common_pb2.LossFn()
    return common_pb2.LossFn(name=loss.name, config=dict(loss.config))


def no_reply(_reply: Any) -> None:
    """The plain value of a reply that carries nothing (OpResponse, Empty)."""
    return None


def metrics(reply: Any) -> dict[str, float]:
    """The metrics of a MetricsResponse."""
    return dict(reply.metrics)

