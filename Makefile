# make test      -- create .venv if missing, install the project + test dependencies, run the tests
#                  (OMP_NUM_THREADS=1 unless set)
# make pretrain  -- install if needed, then pretrain the tiny model with wgrad_hadamard, TP=2, 2 procs
# make bench     -- precision-core micro-benchmarks (ratios against baselines measured in the same run)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch is pinned first: on our CPU machines pip takes the local CPU wheel of 2.13.0; on a GPU
# node the same pin resolves to PyPI's CUDA build. An unpinned torch would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: test pretrain bench install clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev,gpu]'
	touch $(STAMP)

install: $(STAMP)

# One thread per process unless OMP_NUM_THREADS is set: the tests' tensors are small and many tests
# start several processes, so more threads only contend (the precision tests: 16 s with 1, 51 s with
# the default on a 2-core machine).
test: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q

pretrain: $(STAMP)
	$(VENV)/bin/torchrun --nproc-per-node 2 launch/pretrain.py --model-size tiny \
		--precision wgrad_hadamard --tensor-model-parallel-size 2 \
		--train-iters 200 --eval-interval 50 --eval-iters 10 --log-interval 10 \
		--save runs/tiny/checkpoints --load runs/tiny/checkpoints --save-interval 100 --tensorboard-dir runs/tiny/tensorboard

bench: $(STAMP)
	$(PY) launch/bench_quantize.py

clean-venv:
	rm -rf $(VENV)
