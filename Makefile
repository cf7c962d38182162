# Set-up and everyday commands. `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SHELL  := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip on some machines warns once per package about configured-but-absent local indexes; hide that noise.
QUIET_PIP := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
# nnU-Net's network library, installed without its dependencies (see the install rule).
DNA    := dynamic-network-architectures==0.4.4
# nnU-Net's augmentation library, the reference tests/test_augment_*.py compare brats_swap.augment with.
BGV2   := batchgeneratorsv2==0.3.6
# nnU-Net itself, the oracle tests/test_nnunet_predict.py compares predict on imported runs with (tests only),
# and the two packages its predictor imports (acvl-utils; batchgenerators v1, whose own requirements it never
# imports): all without their dependencies, which pull torchvision (another torch) and more.
NNUNET := nnunetv2==2.8.1 acvl-utils==0.2.6 batchgenerators==0.25.5
# torch's own CPU threads; 2 matches the CI machine.
export OMP_NUM_THREADS ?= 2

.PHONY: install test demo lint bench clean

install: $(VENV)/.installed

# Without CUDA, pin the CPU build of torch (2.13.0 is on disk here) in the same pip call as the package, so
# that resolving `torch>=2.4` does not download a multi-GB CUDA build; with CUDA, pip takes the normal build.
# Two pip calls in all (each call costs pip's start and a look at every installed package): the resolved one,
# and one for everything that goes in without its dependencies. `--no-compile`, then `compileall -j 0`: pip
# byte-compiles every module of every package (torch's thousands included) one at a time, about 40% of an
# installation's time; compileall does the same on every core.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA found: installing brats-swap and its dependencies (the default torch build) into $(VENV)"; \
		$(BIN)/pip install --quiet --no-compile -e ".[dev,onnx]" $(QUIET_PIP); \
	else \
		echo "no CUDA: installing brats-swap and its dependencies (the CPU build torch==2.13.0) into $(VENV)"; \
		$(BIN)/pip install --quiet --no-compile "torch==2.13.0" -e ".[dev,onnx]" $(QUIET_PIP); \
	fi
	@# nnU-Net's networks come from dynamic-network-architectures, whose metadata asks for timm, which pulls
	@# torchvision, which pulls another (multi-GB CUDA) torch over the one installed above. The U-Nets we
	@# build import neither: install it without its dependencies (plus einops, its one light import), and
	@# record the torch it must leave in place (tests/test_install.py compares).
	@# batchgeneratorsv2 (tests only) asks for batchgenerators v1, whose own requirements (unittest2,
	@# scikit-learn, ...) its transforms never import; the two they do import, pandas and scikit-image, are in
	@# the dev extra. nnU-Net and its two predictor imports (NNUNET above) go in the same way.
	@$(BIN)/python -c "import torch; print(torch.__version__)" > $(VENV)/torch-version.txt
	@$(BIN)/pip install --quiet --no-compile --no-deps "$(DNA)" "einops>=0.7" "$(BGV2)" $(NNUNET) $(QUIET_PIP)
	@# pip byte-compiles serially; the same compilation on every core (the processes that run as another uid
	@# cannot write the bytecode they would otherwise compile at every start). Its status and lines are dropped:
	@# some packages ship files that are not Python 3 (templates, old examples), which pip skips the same way.
	@$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
	@touch $@

# The suite runs one pytest worker per core (pytest-xdist), each test file on one worker so that a module's
# fixtures are built once; each worker's torch takes one thread, so the workers do not oversubscribe the cores.
# Files are handed out in the order tests/conftest.py collects them (the longest first, so that no long file
# starts last while the other core idles); the 15 slowest tests are printed at the end (docs/testing.md).
TEST_WORKERS ?= auto
test: install
	OMP_NUM_THREADS=1 $(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

demo: install
	$(BIN)/python scripts/demo.py

lint: install
	$(BIN)/ruff check brats_swap tests scripts

clean:
	rm -rf $(VENV) runs data/phantoms* data/cache
