# softsearch: two set-up commands — `make demo` and `make test` — both work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
RUN    ?= runs/demo
PORT   ?= 8000
# pytest options, e.g. `make test PYTEST_ARGS="-m 'not slow'"`
PYTEST_ARGS ?=

.PHONY: demo test test-fast venv system-deps bench lint clean

# The environment is rebuilt only when pyproject.toml changes.
$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,ray]'
	touch $@

venv: $(BIN)/.installed

# Debian packages the tests use: Fashion-MNIST IDX files, the Tux Paint stamps (~800 real PNG clip-art
# images in category folders: the image-folder tests and bench/folder.py) and headless Chromium for the
# web-page test. Installed only when missing and only where apt-get is usable (root); otherwise those
# tests skip with a reason.
system-deps:
	@if { [ ! -d /usr/share/datasets/fashion-mnist ] || [ ! -d /usr/share/tuxpaint/stamps ] \
	      || ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; } \
	    && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian packages: dataset-fashion-mnist tuxpaint-stamps-default chromium chromium-driver"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      dataset-fashion-mnist tuxpaint-stamps-default >/dev/null \
	    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
	    || echo "warning: apt-get failed; the real-data and browser tests will skip with a reason"; \
	fi

# Train on the built-in synthetic dataset, build the index, evaluate (before/after training), then serve.
# Each stage prints its elapsed time; STEPS=N trains N steps instead of the config's 600 (e.g. STEPS=100
# for a quick look).
STEPS ?=
STAGE = @start=$$(date +%s); trap 'echo "[demo] $(1): $$(( $$(date +%s) - start )) s"' EXIT;
demo: venv
	$(call STAGE,train) $(BIN)/softsearch train --config configs/synthetic.toml --set out_dir=$(RUN)/train \
	    $(if $(STEPS),--set steps=$(STEPS))
	$(call STAGE,index build) $(BIN)/softsearch index build --root $(RUN)/index \
	    --checkpoint $(RUN)/train/checkpoint.safetensors --dataset synthetic --split train
	$(call STAGE,eval) $(BIN)/softsearch eval --index $(RUN)/index --queries-dataset synthetic --queries-split test \
	    --compare $(RUN)/train/init.safetensors --out $(RUN)/eval
	@echo "serving http://127.0.0.1:$(PORT)/ (Ctrl-C to stop)"
	$(BIN)/softsearch serve --index $(RUN)/index --host 127.0.0.1 --port $(PORT) --report $(RUN)/eval/report.html

# the linter first (seconds), then the suite
test: venv system-deps lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: venv
	for script in bench/[a-z]*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

# ruff ([tool.ruff] in pyproject.toml): lint and check the formatting, changing nothing
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf runs .pytest_cache
