# Two commands set everything up on a fresh machine:
#   make run    generate text with the built-in default model (creates .venv on first use)
#   make test   run the test suite (creates .venv on first use)
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
MODEL   ?= small
PROMPT  ?= The fastest way to run a mixture of experts on a CPU is

.PHONY: run test venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/moetune generate --model $(MODEL) --prompt "$(PROMPT)" --max-tokens 32

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
