# The course's commands. Each one sets itself up first (idempotent) and says what it does.
#   make course   set up, execute every notebook into build/notebooks/, export slide decks into build/slides/
#   make publish-slides  (teachers) refresh the committed decks in slides/ from build/slides/
#   make test     set up, lint (ruff), run the unit tests, execute every notebook once as a test (nbval)
#   make test-configs  every notebook again with its ci_parameters, as the teacher's edition (papermill, ~10 min)
#   make lab      set up, open JupyterLab on your own copies of the notebooks, my-notebooks/ (localhost only,
#                 a free port, a token; prints the URL); make lab FRESH=03: a fresh copy of notebook 03
#   make bench    set up, run the benchmarks into benchmarks/
#   make stress   set up, run the launcher's stress test (2 x 300 launches) into benchmarks/
#   make gpu-check  on a CUDA machine: the course's GPU paths, measured into benchmarks/gpu.md (< 10 min)
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.course-installed
# The CPU build of torch: 2.13.0+cpu sorts above PyPI's 2.13.0 (a CUDA build), so the installer takes
# it from PyTorch's CPU index when that is reachable, or from a local wheel folder that pip is already
# configured with (PIP_FIND_LINKS / pip.conf find-links). On a GPU machine: make ... TORCH_INDEX=
TORCH_INDEX ?= $(shell $(PYTHON) -c "import socket; socket.gethostbyname('download.pytorch.org'); print('https://download.pytorch.org/whl/cpu')" 2>/dev/null)
FIND_LINKS  ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_VERSION  := 0.13.9
PIP := $(BIN)/python -m pip --disable-pip-version-check
# uv resolves and installs the whole stack in well under a minute (pip takes several); pip is the fallback.
# --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (this CI
# image sets it) Python never writes them either, so every kernel, agent and worker would compile torch
# from source on import: 7.4 s instead of 3.7 s, hundreds of times in `make test`.
INSTALL_ARGS = -c constraints.txt $(if $(FIND_LINKS),--find-links $(FIND_LINKS)) \
	$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch -e ".[notebooks,test,ft,deepspeed]"
QUIET_PIP = 2>&1 | { grep -v "^WARNING: Location" || true; }

.PHONY: setup browser-setup course notebooks slides publish-slides test test-configs lint unit-tests notebook-tests lab lab-authors bench stress gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@echo "==> set-up: virtual environment $(VENV) (from $(PYTHON))"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "==> set-up: torch $(shell grep "^torch==" constraints.txt | cut -d= -f3) CPU build$(if $(TORCH_INDEX), [index $(TORCH_INDEX)])$(if $(FIND_LINKS), [local wheels $(FIND_LINKS)]), course_utils (editable), the notebook and test stack"
	@set -o pipefail; { $(PIP) install -q uv==$(UV_VERSION) $(QUIET_PIP) && \
	  $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python $(if $(TORCH_INDEX),--index-strategy unsafe-best-match) $(INSTALL_ARGS); } || \
	  { echo "    (uv unavailable or failed: falling back to pip, which takes a few minutes)"; \
	    $(PIP) install -q --retries 1 $(INSTALL_ARGS) $(QUIET_PIP); }
	@$(BIN)/python -c "import torch, course_utils; print('    torch', torch.__version__, '| course_utils', course_utils.__version__)"
	@touch $(STAMP)

course: notebooks slides
	@echo "==> course built: executed notebooks in build/notebooks/, decks in build/slides/ (make publish-slides updates slides/)"

notebooks: setup
	@echo "==> executing every notebook headless (papermill) into build/notebooks/"
	@$(BIN)/python tools/build_course.py execute

slides: setup
	@echo "==> exporting slide decks from build/notebooks/ into build/slides/"
	@$(BIN)/python tools/build_course.py slides

# The committed decks change only when a teacher means them to (a run's timings and process ids differ
# on every machine, so `make course` alone never touches slides/); run after `make course`, then commit.
publish-slides: slides
	@echo "==> publishing build/slides/ into slides/ (committed)"
	@$(BIN)/python tools/build_course.py publish

# Both phases always run, so one failing unit test does not hide what the notebooks would say.
test: setup browser-setup
	@$(BIN)/python -m course_utils cluster --clean | grep -v "^nothing" || true  # what a killed cluster run left
	@status=0; \
	$(MAKE) --no-print-directory lint || status=1; \
	$(MAKE) --no-print-directory unit-tests || status=1; \
	$(MAKE) --no-print-directory notebook-tests || status=1; \
	if [ $$status = 0 ]; then echo "==> all tests passed"; else echo "==> some tests FAILED (see above)"; fi; \
	exit $$status

# The browser tests (tests/test_browser.py) drive Debian's chromium and chromedriver. Installed here
# when missing and this is root with apt-get (CI): about a minute, once. Otherwise those tests skip.
browser-setup:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "==> set-up: Debian's chromium and chromedriver for the browser tests (once, about a minute)"; \
	  mkdir -p build; export DEBIAN_FRONTEND=noninteractive; \
	  { apt-get install -y -qq --no-install-recommends chromium chromium-driver >build/apt-chromium.log 2>&1 || \
	    { apt-get update -qq >>build/apt-chromium.log 2>&1 && \
	      apt-get install -y -qq --no-install-recommends chromium chromium-driver >>build/apt-chromium.log 2>&1; }; } \
	    || { tail -n 20 build/apt-chromium.log; exit 1; }; \
	  echo "    $$(chromium --version 2>/dev/null)"; \
	else echo "==> note: chromium/chromedriver missing and not root: the browser tests will skip" \
	  "(apt-get install chromium chromium-driver)"; fi

# Two pytest-xdist workers: half the time on 2 cores, because a multi-process test spends much of its
# time starting processes and waiting on them, not computing. Files stay whole on one worker (their
# module fixtures are shared runs); tests/conftest.py puts the longest file first. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
ifeq ($(TEST_WORKERS),0)
UNIT_WORKERS     := -p no:xdist
NOTEBOOK_WORKERS := -p no:xdist
else
UNIT_WORKERS     := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
NOTEBOOK_WORKERS := -n $(TEST_WORKERS) --dist loadscope
endif

# ruff (rules and format in pyproject.toml): the package (the solutions too), the tests, the tools and the notebooks,
# linted by the same rules and formatted by the one formatter.
LINTED := course_utils tests tools notebooks
lint: setup
	@echo "==> lint (ruff check and ruff format --check: $(LINTED))"
	@$(BIN)/ruff check $(LINTED) && $(BIN)/ruff format --check $(LINTED)

unit-tests: setup browser-setup
	@echo "==> unit tests (pytest tests/, $(TEST_WORKERS) workers)"
	@$(BIN)/python -m pytest tests -q -m "not notebook" $(UNIT_WORKERS)

# Every notebook a second time, with the other values stored in its metadata (`ci_parameters`: another world
# size, other kill steps, 70B on 4 nodes) and as the teacher's edition (computed notes filled in, live widgets):
# tests/test_notebooks.py. Not in `make test`, which executes each notebook once so that it stays within its
# ten minutes; run it before merging a change to a notebook or to what the notebooks call.
test-configs: setup
	@echo "==> every notebook with its ci_parameters, teacher's edition (papermill, $(TEST_WORKERS) workers)"
	@$(BIN)/python -m pytest tests/test_notebooks.py -q -m notebook $(UNIT_WORKERS)

notebook-tests: export COURSE_HEADLESS = 1
notebooks: export COURSE_HEADLESS = 1
unit-tests: export COURSE_HEADLESS = 1

# tools/quiet_outputs.py rides along as a plugin: each cell's output is checked for warnings, temporary
# paths and launcher frames right after nbval ran it (no second execution).
notebook-tests: setup
	@echo "==> executing every notebook as a test (pytest --nbval-lax notebooks/, $(TEST_WORKERS) workers, quiet outputs)"
	@$(BIN)/python -m pytest --nbval-lax -q -p no:cacheprovider -p tools.quiet_outputs $(NOTEBOOK_WORKERS) notebooks

# tools/lab.py: a free port of 127.0.0.1, a token made for this run, the URL printed once; the lab's
# settings (news prompt off) live in build/lab/, not in your home. It opens your own copies in
# my-notebooks/ (ignored by git; notebooks/ stays the course's): `make lab FRESH=03` replaces your copy of
# notebook 03 with a fresh one (after asking; yours is kept in my-notebooks/old/). Authors editing the
# course itself: `make lab-authors` opens notebooks/.
lab: setup
	@$(BIN)/python tools/lab.py $(if $(FRESH),--fresh $(FRESH))

lab-authors: setup
	@$(BIN)/python tools/lab.py --course

bench: setup
	@echo "==> benchmarks into benchmarks/"
	@$(BIN)/python -m tools.bench

# The launcher's long stress test (issue 14): 2 x 300 launches beside a CPU hog; results in benchmarks/.
stress: setup
	@echo "==> launcher stress test: 2 callers x 300 launches beside a CPU hog (about 7 minutes)"
	@$(BIN)/python tools/stress_launch.py --launches 300 --callers 2 --hogs 1 --out build/stress \
	  --json benchmarks/stress-after.json

# Needs a CUDA build of torch: in a fresh checkout on the GPU machine, `make gpu-check TORCH_INDEX=`.
gpu-check: setup
	@echo "==> the course's CUDA paths on this machine's GPUs, into benchmarks/gpu.md and gpu.json"
	@$(BIN)/python tools/gpu_check.py

clean:
	rm -rf build .pytest_cache
