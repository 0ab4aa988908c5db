"""Futures of remote calls: scripts, threads, and a running asyncio loop (Jupyter)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from twinkle_client.futures import Future


def _later(value, delay_s: float = 0.05, error: Exception | None = None) -> Future:
    inner: concurrent.futures.Future = concurrent.futures.Future()

    def finish() -> None:
        time.sleep(delay_s)
        if error is not None:
            inner.set_exception(error)
        else:
            inner.set_result(value)

    threading.Thread(target=finish, daemon=True).start()
    return Future(inner)


def test_result_blocks_until_the_call_finishes_and_raises_its_exception():
    assert _later(3).result(timeout=5) == 3
    failing = _later(None, error=KeyError("boom"))
    with pytest.raises(KeyError, match="boom"):
        failing.result(timeout=5)
    assert isinstance(failing.exception(), KeyError)
    assert failing.done()


def test_result_times_out_without_losing_the_value():
    slow = _later(7, delay_s=0.3)
    with pytest.raises(concurrent.futures.TimeoutError):
        slow.result(timeout=0.01)
    assert slow.result(timeout=5) == 7


def test_await_and_result_async_inside_a_running_loop():
    async def cell() -> tuple:
        first = await _later(1)
        second = await _later(2).result_async(timeout=5)
        third = await asyncio.gather(_later(3).coroutine(), _later(4).coroutine())
        return first, second, tuple(third)

    assert asyncio.run(cell()) == (1, 2, (3, 4))


def test_result_inside_a_running_loop_does_not_deadlock():
    async def cell() -> int:
        return _later(5).result(timeout=5)  # blocks the loop thread, the call runs elsewhere

    assert asyncio.run(cell()) == 5


def test_result_async_timeout_stops_the_wait_not_the_call():
    slow = _later(9, delay_s=0.3)

    async def cell() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await slow.result_async(timeout=0.01)

    asyncio.run(cell())
    assert slow.result(timeout=5) == 9


def test_then_chains_results_and_passes_errors_through():
    assert _later(2).then(lambda v: v * 10).result(timeout=5) == 20
    with pytest.raises(ValueError, match="bad"):
        _later(None, error=ValueError("bad")).then(lambda v: v).result(timeout=5)
    assert Future.completed("x").result() == "x"
