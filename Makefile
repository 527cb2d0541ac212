# divergence: make setup, make test (CPU, minutes); make train / ab / probe / bench / soak.
PY ?= .venv/bin/python
# Optional dependency groups `make setup` installs: test (pytest, wandb>=0.31, and on Linux Triton 3.9, a 286 MB
# wheel that runs the GPU zoo's kernels under its CPU interpreter: 11 s to install) and ray (soak --backend ray, an
# ~80 MB wheel; its test starts a two-node Ray cluster on loopback). EXTRAS=test leaves Ray out; the cluster tests
# then skip.
EXTRAS ?= test,ray
KERNEL ?= fused_embed_rmsnorm
RECIPE ?=
CANDIDATE ?=
OPTS ?=
ARGS ?=

.PHONY: setup test test-all train ab probe probe-calibration report bench soak data-stats clean

# Creates .venv and installs the package. torch is pinned through constraints.txt (torch==2.13.0) so a CPU
# machine keeps the CPU build; where python3 already has a torch (e.g. a CUDA build on a GPU box), the venv sees
# it and pip is pinned to exactly that version, so it is never replaced.
setup:
	@if python3 -c 'import torch' 2>/dev/null; then \
		python3 -m venv --system-site-packages .venv && \
		python3 -c 'import torch; print("torch==" + torch.__version__)' > .venv/constraints.txt; \
	else \
		python3 -m venv .venv && cp constraints.txt .venv/constraints.txt; \
	fi
	.venv/bin/pip install -q -e '.[$(EXTRAS)]' -c .venv/constraints.txt
	@$(PY) -c 'import torch, lightning, divergence; print(f"divergence ready: torch {torch.__version__}, lightning {lightning.__version__}")'

# pytest-xdist workers, each file given whole to one (its module fixtures, e.g. one A/B run, are made once), in
# the order tests/conftest.py puts them (longest first; xdist's own reorders by test count). On the 2-core machine
# (2026-11-23, other work beside it) 2 workers alone took `make test` from 10 min 8 s to 6 min 51 s (4 min 16 s
# with this round's other cuts); 3 were slower than 2 on a third of the suite (123 s vs 99 s). TEST_JOBS=0: one
# process.
TEST_JOBS ?= 2
XDIST = -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

test:
	$(PY) -m pytest -q -x $(XDIST) -m "not slow" tests

test-all:
	$(PY) -m pytest -q $(XDIST) tests

train:
	$(PY) -m divergence.cli train --recipe $(or $(RECIPE),small) $(ARGS)

data-stats:
	$(PY) -m divergence.cli data stats --recipe $(or $(RECIPE),small) $(ARGS)

ab:
	$(PY) -m divergence.cli ab --kernel $(KERNEL) $(if $(CANDIDATE),--candidate $(CANDIDATE)) \
		$(if $(RECIPE),--recipe $(RECIPE)) $(if $(OPTS),--optimizers $(OPTS)) $(ARGS)

probe:
	$(PY) -m divergence.cli probe --kernel $(KERNEL) $(if $(CANDIDATE),--candidate $(CANDIDATE)) $(ARGS)

report:
	$(PY) -m divergence.cli report $(RESULTS)

soak:
	$(PY) -m divergence.cli soak $(or $(SOAK),recipes/soaks/demo.yaml) $(ARGS)

bench:
	$(PY) benchmarks/bench.py $(ARGS)

# The probe's calibration table: calibration members caught by their named family, good ones passed.
probe-calibration:
	$(PY) benchmarks/probe_calibration.py $(ARGS)

clean:
	rm -rf results wandb data/tok-* data/ids-* data/captures
