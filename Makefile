# Two commands set a fresh machine up: `make install` then `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= configs/demo.yaml
SET    ?=

.PHONY: install install-browser test test-fast train train-cluster lint clean bench bench-eval bench-features bench-serving bench-serving-real bench-losses bench-kernel bench-scale bench-scale-features bench-scale-both-ways bench-synthetic notebooks bench-public tune bench-steps bench-tower-call bench-sequential bench-batch-recommend bench-parameter-server bench-index-blocks bench-demo bench-topk bench-filters bench-catalogue bench-freshness

install: $(BIN)/activate
	$(BIN)/pip install --upgrade --quiet pip
	# constraints.txt pins every package to the versions this project was tested with.
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	$(BIN)/python -c "import retrieval, tensorflow as tf, tensorflow_recommenders as tfrs, faiss; print('installed: tensorflow', tf.__version__, '| tfrs', tfrs.__version__, '| faiss', faiss.__version__)"

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# The web page's browser test (tests/serving/test_web_page.py): selenium (the `browser` extra, pinned) and
# Debian's chromium + chromium-driver, which make does not install (apt needs root): it says how.
install-browser: $(BIN)/activate
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev,browser]"
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then \
		echo "browser test: selenium installed, $$(chromium --version 2>/dev/null | head -n 1)"; \
	else \
		echo "browser test: chromium or chromedriver missing; install them with:"; \
		echo "    sudo apt-get install -y chromium chromium-driver"; \
	fi

# The whole suite (what CI runs); test-fast leaves out the tests marked slow (model training, subprocess
# jobs) for the edit-test loop. pytest-xdist runs TEST_WORKERS processes (CI has 2 cores), each taking a
# whole test file at a time so a module's fixtures are built once; TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test:
	$(PYTEST)

test-fast:
	$(PYTEST) -m "not slow"

# ruff (pyflakes, pycodestyle, isort, bugbear, pyupgrade) over the repo, mypy over retrieval/ and pipelines/;
# both configured in pyproject.toml. Fails on the first finding.
lint:
	$(BIN)/ruff check .
	$(BIN)/mypy

# make train [CONFIG=configs/x.yaml] [SET="train.epochs=3 run.name=demo"]
train:
	$(BIN)/python -m pipelines.train --config $(CONFIG) $(foreach kv,$(SET),--set $(kv))

# make train on a parameter-server cluster of local processes (docs/operations.md, "Parameter-server training")
# make train-cluster [CONFIG=...] [SET="..."] [WORKERS=2] [PS=2]
WORKERS ?= 2
PS ?= 2
train-cluster:
	$(BIN)/python -m pipelines.local_cluster --workers $(WORKERS) --ps $(PS) -- --config $(CONFIG) \
		$(foreach kv,$(SET),--set $(kv))

# Optuna search over configs/tune_space.yaml on the evaluation part; the same command again resumes the
# study (TRIALS is the total). Writes trials.csv, best.yaml (a config for make train) in artifacts/tune/<config>.
# make tune [CONFIG=...] [TRIALS=20] [SET="..."] [ARGS="--space configs/x.yaml --study-dir d --keep-bundles"]
TRIALS ?= 20
tune:
	$(BIN)/python -m pipelines.tune --config $(CONFIG) --trials $(TRIALS) $(foreach kv,$(SET),--set $(kv)) $(ARGS)

# Benchmarks write JSON + Markdown to benchmarks/results/ (a few minutes on 2 cores).
bench: bench-eval bench-synthetic

bench-eval:
	$(BIN)/python -m benchmarks.bench_eval

# Seconds to generate synthetic click logs of 100k and 1M clicks (the timing the unit tests do not assert).
bench-synthetic:
	$(BIN)/python -m benchmarks.bench_synthetic

# make train at train.seed 0, 1, 2: the model beside popularity and ALS, each seed's table (~3 min on 2 cores).
bench-demo:
	$(BIN)/python -m benchmarks.bench_demo

# ID-only vs feature towers vs + history on MovieLens 100K, with cold-start users and items (~40 min on 2 cores).
bench-features:
	$(BIN)/python -m benchmarks.bench_features

# Flat vs IVF vs HNSW on 1M clustered synthetic items x 64 dims, HTTP end to end, FAISS vs TFRS BruteForce.
bench-serving:
	nice -n 10 $(BIN)/python -m benchmarks.bench_serving

# The same on the real embeddings of the model make bench-scale trained (it saves them to
# $RETRIEVAL_SCALE_DIR/embeddings, default /tmp/retrieval-scale/embeddings), the synthetic clusters as a
# labelled second row, and a 10M-item memory row (IVF-PQ + refine; ~15-20 min on 2 shared cores, ~6 GiB RAM).
# Not niced: beside un-niced jobs on a shared machine, a niced server would measure their load, not its latency.
RETRIEVAL_SCALE_DIR ?= /tmp/retrieval-scale
bench-serving-real:
	$(BIN)/python -m benchmarks.bench_serving_real --embeddings $(RETRIEVAL_SCALE_DIR)/embeddings $(ARGS)

# Step time of each loss at 10k/100k/1M items, and recall/NDCG/tail recall of every loss vs ALS,
# popularity and the TFRS tutorial recipe on ML-100K and the synthetic default (long: ~1-2 h on 2 cores).
bench-losses:
	nice -n 10 $(BIN)/python -m benchmarks.bench_losses

# Kernel-based sampled softmax (Blanc & Rendle 2018) vs uniform / unigram^0.75 / popularity sampling and
# full softmax, m = 8..512 negatives, on ML-100K and a 100k-item synthetic log (~40 min on 2 cores).
bench-kernel:
	nice -n 10 $(BIN)/python -m benchmarks.bench_kernel

# Out of core: 20M synthetic clicks over 1M items as Parquet shards (in $RETRIEVAL_SCALE_DIR, default
# /tmp/retrieval-scale, ~300 MB), streamed through the job of configs/scale.yaml; peak RSS and throughput.
# ARGS="--clicks 1000000 --items 100000" for a small run; ARGS="--set data.stream.max_train_batches=1500" caps training.
bench-scale:
	nice -n 10 $(BIN)/python -m benchmarks.bench_scale $(ARGS)

# The same log with item and user feature tables and a feature tower (configs/scale_features.yaml:
# early stopping and checkpoints on), training capped at 3000 batches an epoch, then the SIGKILL check
# (the job again twice with 500 batches an epoch: uninterrupted, and killed at its first checkpoint then
# restarted; equal metrics, train_log.csv and weights), into bench_scale_features.{json,md} (~50 min on
# 2 cores). The recorded check ran on its own (bench_scale_resume.md has its command).
bench-scale-features:
	nice -n 10 $(BIN)/python -m benchmarks.bench_scale --features --out benchmarks/results/bench_scale_features \
		--set data.stream.max_train_batches=3000 --resume-check 500 $(ARGS)

# A 2M-click log (100k users, ~430k items) trained in memory and streamed by the same job: equal metrics,
# with each run's wall time and peak RSS, into bench_scale_both_ways.{json,md} (~9 min on 2 cores).
bench-scale-both-ways:
	nice -n 10 $(BIN)/python -m benchmarks.bench_both_ways $(ARGS)

# One process against a localhost parameter-server cluster (1 chief, 2 workers, 2 ps) on a 200k-click
# synthetic log: recall, clicks/s, wall time and each task's peak RSS; then the cluster's memory with
# small and large tables, the workers capped below the tables' bytes, into bench_parameter_server.{json,md}
# (~11 min on 2 cores). ARGS="--clicks 2000000 --users 100000 --items 1000000" for the scale log.
bench-parameter-server:
	nice -n 10 $(BIN)/python -m benchmarks.bench_parameter_server $(ARGS)

# A log replayed period by period: a frozen model, warm-start updates per period (optimizer carried, reset,
# with replay) and a full retrain per period: recall@20 on the next period (overall and on items new in the
# period) and each update's wall time. MovieLens 100K by week, the last 8 weeks (~15 min on 2 cores); the
# synthetic log with churn and drift (1.1M clicks, 12 weekly periods, the last 3): ARGS="--dataset synthetic"
# (~1 h on 2 shared cores).
bench-freshness:
	nice -n 10 $(BIN)/python -m benchmarks.bench_freshness $(ARGS)

# ExactTopK against the bare blocked product of its own blocks and FAISS's IndexFlatIP: 1M and 40,981 items,
# k = 10, 100, 1000, masks on and off, paired runs (~10 min on 2 cores).
bench-topk:
	$(BIN)/python -m benchmarks.bench_exact_topk $(ARGS)

# The catalogue indexed in blocks vs from one matrix: indexing's extra peak RSS at 1M x 256 (~3 min).
bench-index-blocks:
	$(BIN)/python -m benchmarks.bench_index_blocks $(ARGS)

# Eager call of an ID tower over 1M ids, StringLookup vocabulary as a list vs an array (~1 min).
bench-tower-call:
	$(BIN)/python -m benchmarks.bench_tower_call $(ARGS)

# Keras fit step time at 10k/100k/1M users x items (adam, lazy_adam) and checkpoint overhead (~15 min on 2 cores).
bench-steps:
	nice -n 10 $(BIN)/python -m benchmarks.bench_steps $(ARGS)

# The default config, its variants, popularity, ALS (a grid tuned on valid) and the TFRS tutorial recipe on
# every ../shared/datasets/<name>/{train,valid}.txt (LightGCN format); rows append to bench_public.json as
# they finish and are skipped on rerun (hours on 2 cores with Gowalla). ARGS="--datasets ml-1m
# --variants default,popularity,als --seeds 2 --max-epochs 3 --set k=v --force"
bench-public:
	nice -n 10 $(BIN)/python -m benchmarks.bench_public $(ARGS)

# Batch recommendations into a Parquet file (retrieval recommend --users ... --out): users/s at k=100 over
# 1M items, Flat and tuned IVF1024 bundles written from synthetic embeddings (not trained), 20k users.
# ARGS="--items 20000 --users 2000" for a quick run.
bench-batch-recommend:
	nice -n 10 $(BIN)/python -m benchmarks.bench_batch_recommend $(ARGS)

# Filtered search (request filters): p50/p99 and recall at 1/10/50 % selectivity beside unfiltered, Flat and a
# tuned IVF1024 over 500k synthetic 64-d vectors, batch 1 and 64 (a few minutes on 2 cores).
# ARGS="--items 50000 --queries 64 --batches 3" for a quick run.
bench-filters:
	nice -n 5 $(BIN)/python -m benchmarks.bench_filters $(ARGS)

# Amazon Beauty, leave-one-out: the transformer history vs pooled history, popularity and ALS
# (each row a whole job on configs/beauty.yaml); ARGS="--throughput" measures trained pairs/s instead.
bench-sequential:
	nice -n 10 $(BIN)/python -m benchmarks.bench_sequential $(ARGS)

# Live catalogue edits on the served ML-100K feature-tower bundle (trained first): seconds from
# POST /admin/catalogue to the new item being served, failed requests under 4 client threads (~5 min on 2 cores).
bench-catalogue:
	$(BIN)/python -m benchmarks.bench_catalogue $(ARGS)

# Execute notebooks/*.ipynb at full settings and save their outputs (tables, PNG plots) into the
# committed files, volatile metadata stripped (~9 min on 2 busy cores). The tests run them small.
notebooks:
	nice -n 10 $(BIN)/python notebooks/run_notebooks.py

clean:
	rm -rf artifacts .pytest_cache
