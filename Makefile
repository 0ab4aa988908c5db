# Every target sets itself up: a fresh clone needs only Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup proto test test-unit lint demo serve bench soak clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

proto: $(STAMP)
	$(PY) -m twinkle_client._proto.generate

test: $(STAMP)
	$(PY) -m pytest -q

test-unit: $(STAMP)
	$(PY) -m pytest -q -m "not integration"

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

clean:
	rm -rf $(VENV) twinkle-data .pytest_cache
