# Two commands set up everything on a fresh Debian machine with Python 3.11 and Java 17:
#   make test   - the whole test suite
#   make demo   - the whole pipeline end to end on loopback
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-pure test-uvloop test-timing test-compiled-then-uvloop demo venv lint layers typecheck clean system-deps browser-deps compiled test-compiled

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
	@# Debian's prometheus for promtool: tests/test_fleet_prometheus.py checks the shipped rules.
	@if ! command -v promtool >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
	      && systemctl disable --now prometheus >/dev/null 2>&1; true) \
	      || echo "note: could not install prometheus; promtool tests will be skipped"; \
	  else echo "note: promtool not installed and no root/apt; promtool tests will be skipped"; fi; \
	fi

# Debian's chromium for the headless test of the collector's /fleet page (tests/test_fleet_page.py;
# skipped with a reason without it). Apart from system-deps: it is a ~300 MB install.
browser-deps:
	@if ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null) \
	      || echo "note: could not install chromium; the /fleet page test will be skipped"; \
	  else echo "note: chromium not installed and no root/apt; the /fleet page test will be skipped"; fi; \
	fi

# The suite's runs use pytest-xdist: TEST_JOBS worker processes each (default 4 on any core
# count: most tests wait on sockets, subprocesses and timers, about 0.4 of a core each when run
# one after another), whole files to a worker (--dist loadfile: a file's module state and the
# Spark session stay in one process), the longest files first (tests/conftest.py orders the
# files with spark, then slow, tests ahead; --no-loadscope-reorder keeps that order).
# TEST_JOBS=0: every pass in one process, one pass after the other (as before pytest-xdist).
TEST_JOBS ?= 4
ifeq ($(TEST_JOBS),0)
XDIST          :=
TEST_BRANCHES  := 1
else
XDIST          := -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder
TEST_BRANCHES  := 2
endif
UVLOOP_TESTS   := tests/test_broker_server.py tests/test_broker_transport.py \
                  tests/test_broker_pacing.py tests/test_broker_batching.py

# Lint, types and layers first (seconds; they stop a broken tree early), then two branches side
# by side, each printed whole when it ends (--output-sync): the pure-Python suite (test-pure),
# and the compiled build with its tests (test-compiled) followed by the socket-level broker
# suites on uvloop (test-uvloop); the build takes the CPU that the waiting tests leave idle.
# Last, alone, the tests marked timing (test-timing).
test: $(STAMP) system-deps
	$(VENV)/bin/ruff check segments filemq worker_agent collector spark_ingest bench demo cli.py tests
	$(VENV)/bin/mypy segments filemq worker_agent collector spark_ingest bench demo cli.py tests
	$(VENV)/bin/lint-imports --config setup.cfg
	@$(MAKE) --no-print-directory -j $(TEST_BRANCHES) --output-sync=target test-pure test-compiled-then-uvloop
	@$(MAKE) --no-print-directory test-timing

test-pure: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) -m "not timing" tests

# Tests marked timing assert wall-clock bounds (a CONNACK within 1 s under a flood, a PUBACK
# within 2 s beside a 1 MB pipeliner, reads of one PUBACK each): they run after the parallel
# passes, one at a time, so the suite's own load does not decide them; on uvloop too, those
# of the uvloop files.
test-timing: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m timing tests
	FILEMQ_TEST_EVENT_LOOP=uvloop $(PY) -m pytest -q -p no:cacheprovider -rs -m timing $(UVLOOP_TESTS)

test-compiled-then-uvloop: $(STAMP)
	@$(MAKE) --no-print-directory test-compiled
	@$(MAKE) --no-print-directory test-uvloop

# The socket-level broker suites again on uvloop, the loop `filemq broker` takes where it is
# installed (filemq/ops/eventloop.py); the real broker processes of test-pure ran on it already.
# In one process, not under xdist: four files, ~25 s either way, and with the four side by side
# test_broker_batching's one-by-one acker (reads of one PUBACK each) failed twice in three runs
# (it is marked timing now, and runs in test-timing).
test-uvloop: $(STAMP)
	FILEMQ_TEST_EVENT_LOOP=uvloop $(PY) -m pytest -q -p no:cacheprovider -rs -m "not timing" $(UVLOOP_TESTS)

# The optional compiled build (setup.py, docs/PERFORMANCE.md): the hot-path modules compiled
# with mypyc in a COPY of the tree, build/compiled/, so the working tree stays pure Python and
# editable. Run from there: cd build/compiled && ../../.venv/bin/python cli.py --version.
# The copy is refreshed in place (make clean removes it).
COMPILED        := build/compiled
MYPYC_OPT_LEVEL ?= 3
COMPILE_JOBS    ?= 2
# One C file per module, compiled COMPILE_JOBS at a time (pip's build: MYPYC_MULTI_FILE=0).
MYPYC_MULTI_FILE ?= 1
COMPILED_TESTS  := tests/test_build.py tests/test_codec.py tests/test_codec5.py \
                   tests/test_record.py tests/test_segment.py tests/test_log.py tests/test_commit.py \
                   tests/test_topics.py tests/test_offsets.py tests/test_groups.py tests/test_queue.py \
                   tests/test_retained.py tests/test_acl.py tests/test_broker_session.py \
                   tests/test_broker_mqtt5_session.py tests/test_codec5_runs.py tests/test_broker_mqtt5_runs.py \
                   tests/test_publisher_runs.py tests/test_run_caches.py tests/test_properties_publish.py \
                   tests/test_connection_machine.py tests/test_broker_qos_machine.py tests/test_qos_state.py \
                   --deselect tests/test_queue.py::test_a_failing_offset_write_is_logged_once_until_it_works_again \
                   --deselect tests/test_broker_session.py::test_group_offsets_persisted_soon_after_acks
# (The two deselected tests hand the compiled code duck-typed fakes of ConsumerGroup and Queue,
# where the compiled build checks the declared native class; everything else runs.)
HAVE_CC = $(PY) -c "import os, shutil, sys, sysconfig; \
	cc = (os.environ.get('CC') or sysconfig.get_config_var('CC') or 'cc').split()[0]; \
	h = os.path.join(sysconfig.get_paths()['include'], 'Python.h'); \
	sys.exit(0 if shutil.which(cc) and os.path.exists(h) else 1)"

compiled: $(STAMP)
	@$(HAVE_CC) || { echo "make compiled: no C compiler or no Python headers (Python.h) on this machine;" \
	  "the compiled build needs both (Debian: apt-get install gcc python3-dev)." \
	  "The default install (pip install .) is pure Python and needs neither." >&2; exit 1; }
	mkdir -p $(COMPILED)
	tar --exclude=./.git --exclude=./build --exclude=./.venv --exclude=__pycache__ --exclude='*.so' \
	  --exclude=.mypy_cache --exclude=.pytest_cache --exclude=.ruff_cache --exclude=.hypothesis \
	  --exclude='*.egg-info' --exclude=./demo-run --exclude=./spark-warehouse --exclude=./metastore_db \
	  -cf - . | tar -xf - -C $(COMPILED)
	cd $(COMPILED) && FILEMQ_COMPILE=1 MYPYC_OPT_LEVEL=$(MYPYC_OPT_LEVEL) MYPYC_MULTI_FILE=$(MYPYC_MULTI_FILE) $(abspath $(PY)) setup.py -q build_ext --inplace -j $(COMPILE_JOBS)
	cd $(COMPILED) && $(abspath $(PY)) cli.py --version

# The codec, segments and broker-core tests again, against the compiled copy; test_build.py
# asserts there that the modules really are compiled. Without a C compiler it says so and
# runs only test_build.py, which skips with that reason.
test-compiled: $(STAMP)
	@if $(HAVE_CC); then \
	  $(MAKE) --no-print-directory compiled && \
	  cd $(COMPILED) && FILEMQ_EXPECT_COMPILED=1 PYTHONPATH=$(CURDIR)/$(COMPILED) \
	    $(abspath $(PY)) -m pytest -q -p no:cacheprovider $(XDIST) $(COMPILED_TESTS); \
	else \
	  echo "note: no C compiler or Python headers: the compiled build is not tested here"; \
	  FILEMQ_EXPECT_COMPILED=1 $(PY) -m pytest -q -p no:cacheprovider -rs tests/test_build.py; \
	fi

demo: $(STAMP) system-deps
	$(VENV)/bin/filemq demo

lint: $(STAMP)
	$(VENV)/bin/ruff check segments filemq worker_agent collector spark_ingest bench demo cli.py tests

layers: $(STAMP)
	$(VENV)/bin/lint-imports --config setup.cfg

typecheck: $(STAMP)
	$(VENV)/bin/mypy segments filemq worker_agent collector spark_ingest bench demo cli.py tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
