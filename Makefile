# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,plot,lora,vision,qlora]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/prefpack quickstart

lint: $(BIN)/.installed
	$(BIN)/ruff check .

test: lint
	$(BIN)/pytest -q -n 2 --dist loadscope

clean:
	rm -rf $(VENV) runs build *.egg-info
