# Two commands set everything up on a fresh machine:  make demo  and  make test.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CKPT   := checkpoints/shapes/best.ckpt

.PHONY: install demo test lint bench notebooks clean

install: $(VENV)/.installed-dev  ## create .venv and install captioner with its dev extra (tests, lint, serve, onnx)

$(VENV)/.installed: pyproject.toml  # captioner alone: all that `make demo` needs
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

demo: $(VENV)/.installed  ## train on the built-in shapes set, caption held-out images, write their overlays, print val/bleu4
	$(BIN)/captioner fit --config configs/shapes.yaml --trainer.enable_progress_bar=false
	$(BIN)/captioner demo --ckpt_path $(CKPT) --overlays overlays/demo

test: install  ## run the test suite on every core (.ci/run adds the tests marked ci; -m slow runs the slow ones)
	$(BIN)/python -m pytest -n auto --dist loadfile

notebooks: install  ## execute both notebooks and write them with their outputs (they are committed executed)
	$(BIN)/python -m tests.test_notebooks

lint: install  ## ruff lint and format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install  ## run every script in benchmarks/ in turn (the tables of docs/benchmarks.md); keep the machine idle
	cd benchmarks && for script in *.py; do \
		echo "== python $$script"; start=$$(date +%s); ../$(BIN)/python $$script || exit 1; \
		echo "== $$script: $$(( $$(date +%s) - start )) s"; echo; \
	done

clean:
	rm -rf $(VENV) lightning_logs checkpoints overlays data/shapes data/shapes-debug
