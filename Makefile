# Two commands set up everything on a fresh Debian machine with Python 3.11 and Java 17:
#   make test   - the whole test suite
#   make demo   - the whole pipeline end to end on loopback
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo venv lint layers typecheck clean system-deps

# The venv is refreshed only when the package metadata changes (idempotent).
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,collector,spark]'
	touch $(STAMP)

venv: $(STAMP)

# Debian's mosquitto broker and clients are interop peers and benchmark baselines.
# Installed when the machine allows (root + apt); tests skip with a reason otherwise.
system-deps:
	@if ! command -v mosquitto_pub >/dev/null 2>&1 || ! test -x /usr/sbin/mosquitto; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto mosquitto-clients >/dev/null \
	      && systemctl disable --now mosquitto >/dev/null 2>&1; true) \
	      || echo "note: could not install mosquitto; interop tests will be skipped"; \
	  else echo "note: mosquitto not installed and no root/apt; interop tests will be skipped"; fi; \
	fi

test: $(STAMP) system-deps
	$(VENV)/bin/ruff check segments filemq worker_agent collector spark_ingest bench demo cli.py tests
	$(VENV)/bin/mypy segments filemq worker_agent collector spark_ingest bench demo cli.py
	$(VENV)/bin/lint-imports --config setup.cfg
	$(PY) -m pytest -q -p no:cacheprovider tests

demo: $(STAMP) system-deps
	$(VENV)/bin/filemq demo

lint: $(STAMP)
	$(VENV)/bin/ruff check segments filemq worker_agent collector spark_ingest bench demo cli.py tests

layers: $(STAMP)
	$(VENV)/bin/lint-imports --config setup.cfg

typecheck: $(STAMP)
	$(VENV)/bin/mypy segments filemq worker_agent collector spark_ingest bench demo cli.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
