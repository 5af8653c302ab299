# The course's commands. Each one sets itself up first (idempotent) and says what it does.
#   make course   set up, execute every notebook into build/notebooks/, export slide decks into slides/
#   make test     set up, run the unit tests, execute every notebook as a test (nbval + papermill)
#   make lab      set up, open JupyterLab on the notebooks (localhost only, token kept)
#   make bench    set up, run the benchmarks into benchmarks/
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.course-installed
# The CPU build of torch: 2.13.0+cpu sorts above PyPI's 2.13.0 (a CUDA build), so pip takes it
# from this index when it can reach it (or from a local wheel); a GPU machine sets TORCH_INDEX=.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP := $(BIN)/python -m pip --disable-pip-version-check

.PHONY: setup course notebooks slides test unit-tests notebook-tests lab bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@echo "==> set-up: virtual environment $(VENV) (from $(PYTHON))"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "==> set-up: torch (pinned in constraints.txt; CPU build unless TORCH_INDEX is emptied)"
	@$(PIP) install -q --retries 1 -c constraints.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch
	@echo "==> set-up: course_utils (editable) and the notebook/test stack"
	@$(PIP) install -q -c constraints.txt -e ".[notebooks,test]"
	@$(BIN)/python -c "import torch, course_utils; print('    torch', torch.__version__, '| course_utils', course_utils.__version__)"
	@touch $(STAMP)

course: notebooks slides
	@echo "==> course built: executed notebooks in build/notebooks/, decks in slides/"

notebooks: setup
	@echo "==> executing every notebook headless (papermill) into build/notebooks/"
	@$(BIN)/python tools/build_course.py execute

slides: setup
	@echo "==> exporting slide decks from build/notebooks/ into slides/"
	@$(BIN)/python tools/build_course.py slides

test: unit-tests notebook-tests
	@echo "==> all tests passed"

unit-tests: setup
	@echo "==> unit tests (pytest tests/)"
	@$(BIN)/python -m pytest tests -q

notebook-tests: export COURSE_HEADLESS = 1
notebooks: export COURSE_HEADLESS = 1
unit-tests: export COURSE_HEADLESS = 1

notebook-tests: setup
	@echo "==> executing every notebook as a test (pytest --nbval-lax notebooks/)"
	@$(BIN)/python -m pytest --nbval-lax -q -p no:cacheprovider notebooks

lab: setup
	@echo "==> JupyterLab on http://127.0.0.1 (token kept; Ctrl-C to stop)"
	@$(BIN)/jupyter lab --ip=127.0.0.1 --no-browser notebooks

bench: setup
	@echo "==> benchmarks into benchmarks/"
	@$(BIN)/python -m course_utils bench

clean:
	rm -rf build .pytest_cache
