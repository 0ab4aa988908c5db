"""How long a test waits for a subprocess it runs to the end (an example, a bench's smoke
run): a guard against a hang, not a measure of speed.

`bench.gpu --small` takes about 90 s on a quiet 2-core machine and ran past 300 s beside
two other test jobs (2026-12-06, an AMD EPYC at load 5), so the bound leaves room for a
machine several times slower than quiet, and still ends a hung run well inside CI's 90
minutes."""

import pytest

SUBPROCESS_TIMEOUT_S = 1800

WAITS_FOR_A_SUBPROCESS = pytest.mark.timeout(SUBPROCESS_TIMEOUT_S + 120)
"""The pytest-timeout of a test that runs one such subprocess: the suite's 600 s would end
it first on a loaded machine (it did, beside two CPU burners, 2026-12-06)."""
