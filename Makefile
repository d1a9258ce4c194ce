# `make serve`: install, then serve the built-in demo model. `make test`: install, then run the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: install serve test test-slow clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(PY) -m compiled_llm serve $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
