# Every target sets itself up: a fresh clone needs only Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# tinker-cookbook and its dependencies live in their own venv: `make test` never sees them.
COOKBOOK_VENV ?= .venv-cookbook
COOKBOOK_PY := $(COOKBOOK_VENV)/bin/python
COOKBOOK_SPEC ?= tinker-cookbook[math-rl]==0.6.1
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.installed

# The oldest transformers and peft pyproject.toml accepts: `make test-oldest` runs the
# engine's tests (everything that touches either) against them.
OLDEST_VENV ?= .venv-oldest
OLDEST_SPEC ?= transformers==5.0.0 peft==0.18.0
OLDEST_STAMP := $(OLDEST_VENV)/.installed

.PHONY: setup proto test test-long test-unit test-oldest bench-check lint demo serve bench soak cookbook-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

proto: $(STAMP)
	$(PY) twinkle_wire/_proto/generate.py

# Two pytest workers (pytest-xdist), each test file on one of them: the suite's server
# processes spend much of their time starting and waiting, so two files at once keep 2
# cores busier. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -m "not bench_smoke and not long" $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Tests left out of make test to keep it within 15 minutes on 2 cores (64 training runs
# paging through 4 slots; ranks that hang or die, whose tests wait out timeouts; two
# nodes meeting at a rendezvous; a few minutes): CI runs them after make test.
test-long: $(STAMP)
	$(PY) -m pytest -q -m long

# The benchmark scripts' smoke runs (bench.gpu on the CPU, bench.sampling --quick): they
# keep the scripts working, take about two minutes, and measure nothing make test needs.
bench-check: $(STAMP)
	$(PY) -m pytest -q -m bench_smoke

test-unit: $(STAMP)
	$(PY) -m pytest -q -m "not integration and not bench_smoke and not long"

$(OLDEST_STAMP): pyproject.toml Makefile
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet '$(TORCH_SPEC)'
	$(OLDEST_VENV)/bin/python -m pip install --quiet -e '.[dev]' $(OLDEST_SPEC)
	touch $(OLDEST_STAMP)

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/python -m pytest -q tests/engine

lint: $(STAMP)
	$(PY) -m ruff check .

demo: $(STAMP)
	$(PY) examples/demo.py

serve: $(STAMP)
	$(VENV)/bin/twinkle-server serve --model tiny

bench: $(STAMP)
	$(PY) -m bench

soak: $(STAMP)
	$(PY) -m bench.soak

# CPU torch first (plain `torch` would pull a CUDA build). The `math-rl` extra is what
# recipes/math_rl and rl_loop import (sympy, pylatexenc, math-verify). If pip cannot resolve
# the cookbook (0.6.1 pins tml-renderers>=0.4.1, which only Inkling models use and which an
# index may lack), install it with --no-deps plus its other requirements and the extra's.
$(COOKBOOK_STAMP): Makefile
	test -x $(COOKBOOK_PY) || $(PYTHON) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(COOKBOOK_PY) -m pip install --quiet '$(COOKBOOK_SPEC)' || { \
	  echo "cookbook-check: installing $(COOKBOOK_SPEC) without tml-renderers"; \
	  $(COOKBOOK_PY) -m pip install --quiet --no-deps '$(COOKBOOK_SPEC)' && \
	  $(COOKBOOK_PY) -c "import importlib.metadata as m; print('\n'.join(r.split(';')[0] \
	    for r in m.requires('tinker-cookbook') if ('extra ==' not in r or 'math-rl' in r) \
	    and 'tml-renderers' not in r))" > $(COOKBOOK_VENV)/cookbook-requirements.txt && \
	  $(COOKBOOK_PY) -m pip install --quiet -r $(COOKBOOK_VENV)/cookbook-requirements.txt; }
	touch $(COOKBOOK_STAMP)

# tinker-cookbook's own recipes, unchanged (rl_loop, math_rl, weights.download, ...), with
# the stock tinker SDK against a server run from $(VENV); `examples/cookbook_check.py
# --list` names the parts, CHECK_ARGS='--only rl_loop_gspo' runs some.
cookbook-check: setup $(COOKBOOK_STAMP)
	$(COOKBOOK_PY) examples/cookbook_check.py $(CHECK_ARGS)

clean:
	rm -rf $(VENV) $(COOKBOOK_VENV) $(OLDEST_VENV) twinkle-data .pytest_cache
