"""The ranks' call channel: a call's numpy arrays (sent apart from its pickled header, as
one byte tensor) arrive with their dtype, shape and values, writable; answers come back
over a channel of two ranks."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_calls_arrays_arrive_whole_and_answers_come_back_over_a_pair():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "tests.server.channel_ranks"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("{")))
    assert result == {"answer": [True, True, True], "agreed": {"step": 3}}
