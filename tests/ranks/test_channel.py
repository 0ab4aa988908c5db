"""The ranks' call channel: a call's numpy arrays (sent apart from its pickled header, as
one byte tensor) arrive with their dtype, shape and values, writable; answers come back
over a channel of two ranks."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_calls_arrays_arrive_whole_and_answers_come_back_over_a_pair():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "tests.ranks.channel_ranks"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("{")))
    assert result == {"answer": [True, True, True], "agreed": {"step": 3}}


def test_a_calls_arrays_travel_beside_its_pickled_header_not_inside_it():
    """A megabyte of token ids leaves a header of a few hundred bytes: the arrays go as
    one byte tensor, never through pickle."""
    import io

    import numpy as np

    from twinkle_server.ranks.channel import _Pickler

    call = ("forward", {"tokens": np.arange(2**17, dtype=np.int64), "name": "a"})
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(call)
    assert len(buffer.getvalue()) < 500
    assert [a.nbytes for a in pickler.arrays] == [2**20]
