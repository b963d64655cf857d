# Two commands do all the set-up themselves on a fresh machine (Python 3.11, CPU only):
#   make demo   a local swarm of 4 peers elects a coordinator, which plans a small GPT that the
#               data owner then trains on the Python stdlib's source (make demo-digits: a CNN)
#   make test   lint + the whole test suite (make test-fast: the tests that start no process)
# The venv is built on first use; constraints.txt keeps pip on the CPU build of torch.

PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: demo demo-digits test test-fast lint clean bench-wan

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fusionp2p --log-level warning train --local 4 --config demos/stdlib_gpt.toml

demo-digits: $(STAMP)
	$(VENV)/bin/python demos/digits_cnn.py

bench-wan: $(STAMP)  # root: builds an emulated WAN of network namespaces (~50 + ~25 min here)
	$(VENV)/bin/python -m benchmarks.wan
	$(VENV)/bin/python -m benchmarks.wan --model resnet18

lint: $(STAMP)
	$(VENV)/bin/ruff check fusionp2p tests benchmarks demos
	$(VENV)/bin/ruff format --check fusionp2p tests benchmarks demos
	$(VENV)/bin/mypy fusionp2p

test: lint
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=25

test-fast: $(STAMP)  # under 3 minutes: everything but the tests that start processes or take long
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not swarm and not slow"

clean:
	rm -rf $(VENV) *.egg-info
