# Two commands set a fresh machine up: `make install` then `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= configs/default.yaml
SET    ?=

.PHONY: install test train evaluate lint clean

install: $(BIN)/activate
	$(BIN)/pip install --upgrade --quiet pip
	# constraints.txt pins every package to the versions this project was tested with.
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	$(BIN)/python -c "import retrieval, tensorflow as tf, tensorflow_recommenders as tfrs, faiss; print('installed: tensorflow', tf.__version__, '| tfrs', tfrs.__version__, '| faiss', faiss.__version__)"

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

test:
	$(BIN)/python -m pytest -q

# make train [CONFIG=configs/x.yaml] [SET="train.epochs=3 run.name=demo"]
train:
	$(BIN)/python -m pipelines.train --config $(CONFIG) $(foreach kv,$(SET),--set $(kv))

clean:
	rm -rf artifacts .pytest_cache
