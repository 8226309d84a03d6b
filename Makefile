# Two entry points for a fresh machine (Python 3.10+ with venv):
#   make demo   set up, then train the offline digits demo with 2 CPU processes
#   make test   set up, then run the whole test suite (installs Debian's Fashion-MNIST, headless Chromium, which
#               opens the reports in the tests, and a Chinese font, if missing)
# and one for a lent GPU machine (no venv, no network there: its own python3):
#   make bench-gpu   the whole GPU table in one device call, into $OUT (default outputs/bench-gpu); first, on the
#                    CPU machine: python scripts/bench_gpu.py prepare --shared ../shared, then carry .bench-gpu
VENV ?= .venv
PYTHON ?= python3
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
CJK_FONT := /usr/share/fonts/truetype/wqy/wqy-microhei.ttc
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
# pytest-xdist workers, each taking a whole test file at a time (a file's tests share its runs): 2 finish the
# suite 1.25x sooner on 2 cores, where a launch's start and end leave a core idle (BENCHMARKS.md); 0: one process.
# Each worker's runs take its share of the cores as threads (tests/conftest.py: OMP_NUM_THREADS). The files are handed
# out longest first (tests/conftest.py: LONGEST_FIRST), not by their number of tests (xdist's default), so that the
# workers end together
WORKERS ?= 2
PYTEST := $(VENV)/bin/python -m pytest -n $(WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: setup demo test test-fast browser bench-gpu

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -r requirements-dev.txt
	touch $@

$(FASHION_MNIST):
	$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq dataset-fashion-mnist

# a font with Chinese characters: a test draws class names in Chinese into the confusion matrix
$(CJK_FONT):
	$(SUDO) apt-get install -y -qq fonts-wqy-microhei || { $(SUDO) apt-get update -qq \
		&& $(SUDO) apt-get install -y -qq fonts-wqy-microhei; }

# `python -m accelerate.commands.launch` is `accelerate launch` without its other subcommands' imports (2 s less here)
demo: setup
	$(VENV)/bin/python -m accelerate.commands.launch --config_file accelerate_configs/cpu.yaml scripts/train_mnist.py \
		--dataset digits --epochs 20 --output_dir outputs/digits --overwrite

browser:
	@command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null || { $(SUDO) apt-get update -qq \
		&& $(SUDO) apt-get install -y -qq chromium-headless-shell || $(SUDO) apt-get install -y -qq chromium; }

test: setup $(FASHION_MNIST) $(CJK_FONT) browser
	$(PYTEST) --durations=15

test-fast: setup
	$(PYTEST) -m "not slow"

bench-gpu:
	$(PYTHON) scripts/bench_gpu.py run --out $${OUT:-outputs/bench-gpu}
