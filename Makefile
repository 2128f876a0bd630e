# shardtool — the two commands a new user types: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch 2.13.0 is a local CPU wheel on our machines; any other torch spec downloads gigabytes.
ORACLE := torch==2.13.0 transformers
# lm-evaluation-harness for tests/serve/test_lm_eval.py; installed beside the oracle (its hf extra needs torch).
EVAL   := lm-eval[api,hf]==0.4.13

.PHONY: install oracle browser test test-fast demo bench bench-llamacpp bench-loadgen bench-seed bench-cluster-scale fuzz clean

# setup.py and the C source: an edit rebuilds the kernels extension in place (pip install -e).
# Two steps: the package alone (all `make demo` needs), then the test extras (Ray, moto, model-signing, ...: minutes).
$(VENV)/.base: pyproject.toml setup.py runtime/model/_kernels.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed: $(VENV)/.base
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The parity oracle (transformers on the CPU). Where it cannot be installed the parity tests skip and say why.
$(VENV)/.oracle: $(VENV)/.base
	$(PIP) install -q $(ORACLE) && touch $@ || echo "make: torch/transformers unavailable; parity tests will skip"

# lm-eval apart from the oracle: `make demo` needs torch + transformers only, not lm-eval's dependency tree.
$(VENV)/.lm-eval: $(VENV)/.oracle
	$(PIP) install -q $(ORACLE) '$(EVAL)' && touch $@ || echo "make: lm-eval unavailable; the lm-evaluation-harness test will skip"

oracle: $(VENV)/.oracle $(VENV)/.lm-eval

# Debian's chromium, for the status page's test in a real headless browser (tests/serve/test_status.py). Installed
# where apt-get and root are at hand; elsewhere that test skips and says why.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }; }; } || \
	  echo "make: chromium unavailable (needs apt-get and root); the status page's browser test will skip"

# pytest-xdist: one worker per core (TEST_WORKERS=1 for a single process). `--dist loadgroup` keeps the tests that
# share a session-wide server (tests/conftest.py's XDIST_GROUPS: the Ray head, the S3 and mirror servers) on one
# worker; every other test goes to whichever worker is free.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup

test: install oracle browser
	$(PY) -m pytest -q $(XDIST) --durations=25

test-fast: install
	$(PY) -m pytest -q $(XDIST) -m "not oracle and not slow"

# The demo's backdoor is made and shown with torch + transformers (another runtime); shardtool never imports them.
demo: $(VENV)/.base $(VENV)/.oracle
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash examples/demo.sh

# References: b3sum (Debian), sigstore's model_signing (its own venv: it pins its own dependencies).
.venv-bench/bin/model_signing:
	$(PYTHON) -m venv .venv-bench
	.venv-bench/bin/pip install -q model-signing pyopenssl || echo "make: model-signing unavailable; its ratio is skipped"

bench: install oracle .venv-bench/bin/model_signing
	command -v b3sum >/dev/null || (apt-get install -y b3sum >/dev/null 2>&1 || echo "make: b3sum unavailable")
	MODEL_SIGNING_BIN=$(CURDIR)/.venv-bench/bin/model_signing $(PY) benchmarks/run_all.py

# llama.cpp, the compute reference (not part of `make test` or `make bench`): llama-cpp-python built from its PyPI
# sdist for this CPU, into .venv-bench, once. The sdist is kept: its vendored convert_hf_to_gguf.py and gguf-py turn
# the generated checkpoints into GGUFs (the converter needs torch and transformers).
LLAMA_CPP    := 0.3.36
LLAMA_SDIST  := .venv-bench/sdist/llama_cpp_python-$(LLAMA_CPP).tar.gz
# AMX is left out: on a CPU that reports it inside a virtual machine, ggml's AMX matmul (chosen for Q8_0/Q4_0 weights
# under GGML_NATIVE) dies with SIGSEGV; GCC's explicit -mno-* flags win over -march=native whatever their order. The
# stamp names the build, so a .venv-bench from before is rebuilt.
NO_AMX       := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
.venv-bench/.llama-cpp-$(LLAMA_CPP)-noamx:
	test -x .venv-bench/bin/python || $(PYTHON) -m venv .venv-bench
	.venv-bench/bin/pip download -q --no-binary :all: --no-deps -d .venv-bench/sdist llama-cpp-python==$(LLAMA_CPP)
	.venv-bench/bin/pip uninstall -q -y llama-cpp-python
	CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF '-DCMAKE_C_FLAGS=$(NO_AMX)' '-DCMAKE_CXX_FLAGS=$(NO_AMX)'" .venv-bench/bin/pip install -q --no-binary llama-cpp-python $(LLAMA_SDIST)
	.venv-bench/bin/pip install -q $(ORACLE) sentencepiece pyyaml tqdm requests
	touch $@

# llama.cpp's own HTTP server, from the same sdist's vendored sources with the same flags (the serving benches start
# it as `llama-server -m GGUF -np N`): built static (no libllama.so to find), without the web UI (its assets would be
# downloaded) and without OpenSSL (the bench speaks plain HTTP on localhost).
LLAMA_SERVER_BUILD := .venv-bench/llama-server-build
.venv-bench/bin/llama-server: .venv-bench/.llama-cpp-$(LLAMA_CPP)-noamx
	rm -rf $(LLAMA_SERVER_BUILD) && mkdir -p $(LLAMA_SERVER_BUILD)
	tar -xzf $(LLAMA_SDIST) -C $(LLAMA_SERVER_BUILD)
	cmake -S $(LLAMA_SERVER_BUILD)/llama_cpp_python-$(LLAMA_CPP)/vendor/llama.cpp -B $(LLAMA_SERVER_BUILD)/build \
	  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DGGML_CUDA=OFF \
	  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
	  '-DCMAKE_C_FLAGS=$(NO_AMX)' '-DCMAKE_CXX_FLAGS=$(NO_AMX)' >/dev/null
	cmake --build $(LLAMA_SERVER_BUILD)/build --target llama-server -j2 >/dev/null
	install -m 755 $(LLAMA_SERVER_BUILD)/build/bin/llama-server $@.tmp && mv $@.tmp $@
	rm -rf $(LLAMA_SERVER_BUILD)

bench-llamacpp: install .venv-bench/.llama-cpp-$(LLAMA_CPP)-noamx
	$(PY) benchmarks/bench_llamacpp.py

# guidellm, an existing OpenAI-serving load generator, in its own venv (its pins are not the project's): guidellm
# requires torch, and left alone pip picks a CUDA torch of gigabytes, so torch is pinned to the local CPU wheel.
# The sweep runs serve and llama-server on the same GGUF (needs .venv-bench/bin/llama-server).
LOADGEN := guidellm==0.8.1 torch==2.13.0
.venv-loadgen/.guidellm:
	$(PYTHON) -m venv .venv-loadgen
	.venv-loadgen/bin/pip install -q $(LOADGEN)
	touch $@

bench-loadgen: install .venv-loadgen/.guidellm .venv-bench/bin/llama-server
	$(PY) benchmarks/bench_loadgen.py

# The seed's case on an emulated small machine (root: cgroup memory cap + read throttle): a 17.4 GiB DeepSeek-V3-shaped
# model under M = 2 GiB at 0.85 GB/s; about 45 GiB of disk under /var/tmp and an hour; figures in bench-seed.json
# (the runs docs/seed-scale.md quotes: docs/seed-scale.json).
bench-seed: install
	$(PY) benchmarks/bench_seed.py --json bench-seed.json

# The cluster where it matters (issue 39, not part of `make bench`): a 2.28 GiB DeepSeek-layout model held by 2 (and
# 3, R = 2) `shardtool node`s on emulated machines capped at M = 1.5 GiB against one machine capped at M streaming it
# at 0.85 GB/s; needs root (cgroups), ~3 GiB of disk under /work/scratch/scale39 and ~10 minutes; figures in
# bench-cluster-scale.json (the runs docs/scaling.md quotes: docs/cluster-scale.json).
bench-cluster-scale: install
	$(PY) benchmarks/bench_cluster_scale.py --repeats 5 --json bench-cluster-scale.json

fuzz: install
	$(PY) -m pytest -q tests/fuzz --hypothesis-profile=long

clean:
	rm -rf $(VENV) .venv-bench .venv-loadgen demo .pytest_cache .hypothesis
