# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,plot,lora]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/prefpack prepare examples/data/hh-rlhf-harmless-base/train_2k.jsonl.gz \
		--tokenizer examples/tokenizers/gpt-neox-20b --output runs/demo/hh-train \
		--max-length 512 --skip-invalid --overwrite
	$(BIN)/prefpack inspect runs/demo/hh-train --row 1

lint: $(BIN)/.installed
	$(BIN)/ruff check .

test: lint
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) runs build *.egg-info
