# The two commands (see README.md). Both do the whole set-up first (tools/setup.sh).
VENV ?= .venv
ARGS ?=

.PHONY: serve test setup
serve: setup
	$(VENV)/bin/python -m pyserve $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest -q tests $(ARGS)

setup:
	PYSERVE_VENV=$(VENV) bash tools/setup.sh
