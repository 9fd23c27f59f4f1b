# The README's commands. `make train` and `make test` set everything up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build where that is what the machine has; set TORCH_SPEC to taste (e.g. for CUDA wheels).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.setup-done

.PHONY: setup train test test-fast lint format benchmark plot clean slurm-start slurm-stop

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an open range with no torch installed pulls a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

train: setup  # with no ARGS: Pong with the defaults, and how long that takes on this kind of machine
	@test -n "$(ARGS)" || { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
	  && echo "Pong with the defaults on a GPU machine with $$(nproc) cores: +18 in minutes to tens of minutes." \
	  || echo "Pong with the defaults on $$(nproc) CPU cores: about 1 h to +18 on 2 cores (3M of 20M agent steps, ~6 h in all); more cores, less time."; \
	  echo "The progress line's ETA is for this machine. Ctrl-C stops with a checkpoint and prints the command that resumes."; }
	$(PY) -m torchbeast_hydra $(ARGS)

# Test files run in TEST_WORKERS processes (pytest-xdist), a file's tests in one of them (their
# module fixtures and the SLURM cluster are shared within a file); most tests wait on training
# processes, so 2 workers finish the suite in about 2/3 of the time on 2 cores.
TEST_WORKERS ?= 2

test: setup lint  # the whole suite (what CI runs), after the style checks
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast: setup lint  # the edit loop (under 3 minutes on 2 cores): all but the tests marked slow or slurm
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not slurm" $(PYTEST_ARGS)

lint: setup  # ruff, configured in pyproject.toml; `make format` fixes what it can
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

plot: setup  # make plot ARGS=outputs/multirun/DATE/TIME (default: the newest run or sweep)
	$(PY) -m torchbeast_hydra.analysis $(ARGS)

benchmark: setup  # make benchmark ARGS="scaling" or ARGS="pipeline --clients 2 4" (default: train)
	$(PY) benchmarks/throughput.py $(or $(ARGS),train)

# A single-node SLURM cluster on this machine (root; installs slurmctld, slurmd and munge from apt
# when missing) for trying hydra/launcher=slurm; the tests start and stop it themselves.
slurm-start:
	scripts/slurm/start.sh

slurm-stop:
	scripts/slurm/stop.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
