# Quickstart: `make demo` and `make test`. Both create .venv and install on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install demo test lint typecheck unit protos bench clean compose-demo test-compose bench-compose test-py313 test-gpu test-mpi test-slurm test-cluster browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[dev,demo,test]'
	# torch's CPU build only for the cross-checks against torch (they skip without it); never required.
	$(BIN)/python -m pip install -q torch==2.13.0 || echo "torch not installed: the torch cross-checks skip"
	# torchvision 0.28 (torch 2.13's pair) for its ResNet-18 in the drop-in tests (left out without it), in a folder of
	# its own, not site-packages: its compiled operators do not load into torch's CPU build, and transformers imports
	# torchvision wherever it finds one (tests/workers/_torch_models.py loads it without those operators).
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/torchvision torchvision==0.28.0 \
	  || echo "torchvision not installed: the drop-in tests leave its ResNet-18 out"
	# timm for its Vision Transformer in the drop-in tests, beside torchvision and for the same reason (it requires
	# torchvision; tests/workers/_torch_models.py loads it after torchvision). Its other needs come with transformers.
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/timm timm==1.0.31 \
	  || echo "timm not installed: the drop-in tests leave its ViT out"
	# peft (LoRA on the drop-in tests' models) after torch, without dependencies: it requires torch, which must be
	# the CPU build above or none (its tests skip without it); accelerate and psutil are its other needs.
	$(BIN)/python -m pip install -q --no-deps peft==0.21.2 accelerate==1.15.0 psutil==7.2.2 \
	  || echo "peft not installed: the LoRA drop-in tests skip"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/paramplane demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check client node coordinator tests benchmarks examples scripts

typecheck: $(STAMP)
	$(BIN)/python scripts/typecheck_tree.py >/dev/null
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not cluster"

test: lint typecheck unit

# Debian's chromium for tests/control/test_live_view.py's headless-browser check (root and apt only; that test skips
# where no chromium can be found). .ci/run calls it as root; bounded to 10 minutes.
browser:
	command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && DEBIAN_FRONTEND=noninteractive timeout 600 sh -c 'apt-get update -qq && apt-get install -y -qq chromium >/dev/null' \
	  || echo "browser: chromium not installed (needs root and apt): the live view's browser test skips"; }

# The gpu-marked tests on a machine with an NVIDIA GPU: installs the gpu extra (cupy, NCCL); torch must be a CUDA
# build there. tests/gpu/test_gpu_stack.py fails (does not skip) where a GPU exists but cupy, NCCL or torch CUDA cannot run.
test-gpu: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[gpu]'
	$(BIN)/python -m pytest -q -ra -m gpu

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

bench: $(STAMP)
	$(BIN)/python -m pip install -q torch==2.13.0 || echo "torch not installed: peers are skipped"
	$(BIN)/paramplane bench collectives --out benchmarks/results/collectives.jsonl
	$(BIN)/python benchmarks/rendezvous.py --out benchmarks/results/rendezvous.jsonl
	$(BIN)/python benchmarks/ddp.py --out benchmarks/results/ddp.jsonl

# TLS=1: the TLS overlay (docker-compose.tls.yml), inter-host frames on gRPC streams.
compose-demo:
	TLS=$(TLS) bash scripts/compose.sh demo

test-compose:
	bash scripts/compose.sh test

# HybridShard step time between the two compose hosts: lanes, gRPC streams, gRPC streams + TLS.
bench-compose:
	bash scripts/compose.sh bench

# mpirun -np 3 of a DDP job with pp.init() and no other setup (root: installs Open MPI from Debian's packages).
test-mpi: $(STAMP)
	command -v mpirun >/dev/null || apt-get install -y -q --no-install-recommends openmpi-bin
	$(BIN)/python -m pytest -q -ra tests/deploy/test_mpi.py

# A real Slurm cluster (slurmctld + two slurmd, each in a network namespace) running sbatch/srun jobs, a node
# killed mid-run and the job requeued (root: installs slurm-wlm from Debian's packages; about 2 minutes).
test-slurm: $(STAMP)
	command -v slurmctld >/dev/null || apt-get install -y -q --no-install-recommends slurm-wlm
	$(BIN)/python -m pytest -q -ra -m cluster tests/deploy/test_slurm.py

# Every cluster topology test: Slurm above, and deploy/kubernetes/ run as network namespaces (about 3 minutes).
test-cluster: test-slurm
	$(BIN)/python -m pytest -q -ra -m cluster tests/deploy/test_kubernetes.py

# The suite under Python 3.13 (Debian trixie in a chroot; root): the top of the declared Python range.
test-py313:
	bash scripts/python313.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
