# shardtool — the two commands a new user types: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch 2.13.0 is a local CPU wheel on our machines; any other torch spec downloads gigabytes.
ORACLE := torch==2.13.0 transformers

.PHONY: install oracle test test-fast demo bench fuzz clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The parity oracle (transformers on the CPU). Where it cannot be installed the parity tests skip and say why.
$(VENV)/.oracle: $(VENV)/.installed
	$(PIP) install -q $(ORACLE) && touch $@ || echo "make: torch/transformers unavailable; parity tests will skip"

oracle: $(VENV)/.oracle

test: install oracle
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not oracle and not slow"

demo: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash examples/demo.sh

bench: install oracle
	command -v b3sum >/dev/null || (apt-get install -y b3sum >/dev/null 2>&1 || echo "make: b3sum unavailable")
	$(PY) benchmarks/run_all.py

fuzz: install
	$(PY) -m pytest -q tests/fuzz --hypothesis-profile=long

clean:
	rm -rf $(VENV) demo .pytest_cache .hypothesis
