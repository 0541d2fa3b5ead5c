# Two commands set everything up on a fresh machine:
#   make run    tune this machine for the built-in default model (≈10 min), write its profile and
#               report (creates .venv on first use); `make generate` generates text with it
#   make test   run the test suite (creates .venv on first use; builds the baselines the tests run
#               against: llama.cpp through llama-cpp-python, ≈5-15 min once, ik_llama.cpp from its
#               sources into the moetune cache, ≈5-15 min once, and kt-kernel's own virtualenv;
#               installs PostgreSQL and Chromium from Debian's packages)
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
BASE    := $(VENV)/.baselines
MODEL   ?= small
PROMPT  ?= The fastest way to run a mixture of experts on a CPU is
BUDGET  ?= 10m

.PHONY: run generate test venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# The peers the tests compare against, built once per venv (pip caches llama-cpp-python's wheel;
# GGML_NATIVE: llama.cpp at its best on this machine, as a user would build it). ik_llama.cpp's
# native build is kept, stamped, in a versioned folder of ~/.cache/moetune: made once per machine.
$(BASE): $(STAMP)
	CMAKE_ARGS="$${CMAKE_ARGS:--DGGML_NATIVE=ON}" $(BIN)/python -m pip install -q -e '.[test,baselines]'
	$(BIN)/python -m suites.baselines.ikllama --setup
	$(BIN)/python -m suites.baselines.ktkernel --setup
	touch $(BASE)

run: $(STAMP)
	$(BIN)/moetune autotune --model $(MODEL) --time-budget $(BUDGET)
	$(BIN)/moetune report

generate: $(STAMP)
	$(BIN)/moetune generate --model $(MODEL) --prompt "$(PROMPT)" --max-tokens 32

test: $(STAMP) $(BASE)
	bash tests/ensure_services.sh
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
