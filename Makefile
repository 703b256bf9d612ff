# The two commands: `make demo` and `make test`. Each creates what it needs (idempotent:
# a second run reuses the environments) and then runs.

# Every path below is relative to the checkout: `make -f path/to/Makefile demo` from any other
# directory re-runs make there.
ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
ifneq ($(CURDIR),$(ROOT))
.PHONY: $(or $(MAKECMDGOALS),env)
$(or $(MAKECMDGOALS),env):
	@$(MAKE) --no-print-directory -C $(ROOT) $(MAKECMDGOALS)
else

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.ktflow-installed
PIP    := $(BIN)/python -m pip --disable-pip-version-check
# The toolchains are installed with uv (pinned in the orchestrator env) so that the one torch 2.9.1
# CUDA stack they share (~6.5 GB of nvidia-*/triton/torch) is stored once: uv hardlinks every file from
# its cache, which lives in the checkout so cache and venvs are on one filesystem. With pip each venv
# had its own copy: 22 GB for the three toolchains instead of 9.5 GB.
export UV_CACHE_DIR ?= $(CURDIR)/.cache/uv
export UV_LINK_MODE := hardlink
export UV_PYTHON_DOWNLOADS := never
# Trust the system's certificate store, as pip does here (uv's own bundle lacks a site's proxy CA).
export UV_NATIVE_TLS := 1
# Compile .pyc at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (it is here), every tool
# process would otherwise recompile torch and transformers from source at each start.
export UV_COMPILE_BYTECODE := 1
UV     := $(BIN)/uv pip install -q
# pytest exit code 5 ("no tests collected") must fail CI, so it is never masked here.
PYTEST_ARGS ?=
# The suite runs in TEST_WORKERS pytest-xdist processes: the tests that share the distributed
# cluster go to one process as one unit (tests/conftest.py's scheduler), the rest to whichever is
# free. Much of the suite waits on servers and subprocesses, so 2 workers help on 2 cores too.
TEST_WORKERS ?= 2
# The training toolchain: its own venv, because LlamaFactory pins a torch/torchaudio pair that
# differs from the orchestrator's (and the KT forks would shadow upstream transformers). It uses the
# same torch 2.9.1 as the KT toolchains, as the KT cookbook does; torchvision/torchaudio must match it.
TRAIN_VENV := .venv-train
TRAIN_STAMP := $(TRAIN_VENV)/.ktflow-installed
TRAIN_PKGS := llamafactory==0.9.5 torch==2.9.1 torchvision==0.24.1 torchaudio==2.9.1
# LlamaFactory 0.9.4 (the last one that parses the legacy-KT keys kt_optimize_rule, cpu_infer,
# chunk_size), unpacked beside the training toolchain so tests can check legacy renders with it.
LEGACY_LF := $(TRAIN_VENV)/llamafactory-0.9.4
LEGACY_STAMP := $(LEGACY_LF)/.ktflow-installed

# The serving toolchain: sglang-kt with its GPU dependencies (flashinfer, the KT builds of sglang's kernels),
# kt-kernel, and the `ktransformers` wheel, which carries sglang's sm90 kernels and the parts the other GPUs'
# kernels are unpacked from at the first start (`pip install kt-kernel sglang-kt` alone lacks them). On a CPU
# box it installs the same and imports (server arguments, kt-kernel); only a GPU host runs the server.
SERVE_VENV := .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.ktflow-installed
SERVE_PKGS := 'ktransformers[sglang]==0.7.2' torch==2.9.1
# The KT 0.7 training toolchain (LlamaFactory-kt and the -kt forks): on this CPU box it is used to
# check rendered KT configs with LlamaFactory-kt's own parser and kt-kernel's own KTConfig.
KT_VENV := .venv-kt-train
KT_STAMP := $(KT_VENV)/.ktflow-installed
KT_PKGS := 'ktransformers[sft]==0.7.2' torch==2.9.1 torchaudio==2.9.1
# The KT toolchains' locks are resolved by uv for the GPU hosts' platform, not this machine's: every KT wheel
# is manylinux_2_35 x86-64 for CPython 3.11/3.12. A lock made for 3.11 resolves the same on 3.12 (checked by
# tests/test_preflight.py); one made for 3.12 would not install on 3.11.
LOCK_TARGET := --python-version 3.11 --python-platform x86_64-manylinux_2_35
COMPILE := $(BIN)/uv pip compile -q --no-header --no-annotate $(LOCK_TARGET)

.PHONY: demo test docs env train-env serve-env kt-train-env gpu-env gpu-env-check browser sshd lock lock-train lock-serve \
	lock-kt-train clean-env

env: $(STAMP)
train-env: $(TRAIN_STAMP)
serve-env: $(SERVE_STAMP)
kt-train-env: $(KT_STAMP)

$(STAMP): pyproject.toml constraints/orchestrator.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints/orchestrator.txt -e '.[dev]'
	@touch $@

# Toolchain venvs are made by the stdlib venv (so they have pip, as users expect) and filled by uv;
# uv comes from the orchestrator env, an order-only prerequisite (a change there reinstalls nothing).
$(TRAIN_STAMP): constraints/train.txt | $(STAMP)
	@test -x $(TRAIN_VENV)/bin/python || $(PYTHON) -m venv $(TRAIN_VENV)
	$(UV) --python $(TRAIN_VENV)/bin/python -c constraints/train.txt $(TRAIN_PKGS)
	@touch $@

$(LEGACY_STAMP): $(TRAIN_STAMP)
	$(UV) --python $(TRAIN_VENV)/bin/python --no-deps --target $(LEGACY_LF) llamafactory==0.9.4
	@touch $@

$(SERVE_STAMP): constraints/serve.txt | $(STAMP)
	@test -x $(SERVE_VENV)/bin/python || $(PYTHON) -m venv $(SERVE_VENV)
	$(UV) --python $(SERVE_VENV)/bin/python -c constraints/serve.txt $(SERVE_PKGS)
	@touch $@

$(KT_STAMP): constraints/kt-train.txt | $(STAMP)
	@test -x $(KT_VENV)/bin/python || $(PYTHON) -m venv $(KT_VENV)
	$(UV) --python $(KT_VENV)/bin/python -c constraints/kt-train.txt $(KT_PKGS)
	@touch $@

# ktflow itself needs Python 3.11+, the KT wheels 3.11 or 3.12: said before anything is made (the preflight says
# the rest once ktflow is installed).
CHECK_PYTHON = $(PYTHON) -c 'import sys; v = sys.version_info[:2]; sys.exit(0 if v in ((3, 11), (3, 12)) else \
	"$(PYTHON) is Python %d.%d: the KT wheels need CPython 3.11 or 3.12; install python3.12 with its venv module \
	(e.g. sudo apt install python3.12 python3.12-venv) and run: make gpu-env PYTHON=python3.12" % v)'

# A networked Linux GPU workstation, from nothing: the preflight names what the host lacks and how to get it
# (exit 2 before anything is installed), then the KT training and serving toolchains from their locks (one
# torch on disk), then the smoke check imports what each must run (sglang's server, kt-kernel's build for this
# CPU, LlamaFactory-kt's trainer; torch.cuda and sglang's kernels for the GPU). docs/guides/workstation.md.
gpu-env:
	@$(CHECK_PYTHON)
	@$(MAKE) --no-print-directory $(STAMP)
	$(BIN)/ktflow preflight --python $(PYTHON)
	@$(MAKE) --no-print-directory $(KT_STAMP) $(SERVE_STAMP)
	$(BIN)/ktflow smoke-check

# The same on a machine without a GPU (CI, this checkout's CPU box): the preflight's CPU, Python, glibc and disk
# checks, both toolchains installed from their locks, the smoke check's CPU parts, and every shipped recipe's
# serving command parsed by the installed sglang-kt. `make test` installs the same toolchains and runs the same
# tests; this target is the short way to check an install.
gpu-env-check:
	@$(CHECK_PYTHON)
	@$(MAKE) --no-print-directory $(STAMP)
	$(BIN)/ktflow preflight --no-gpu --python $(PYTHON)
	@$(MAKE) --no-print-directory $(KT_STAMP) $(SERVE_STAMP)
	$(BIN)/ktflow smoke-check --no-gpu
	$(BIN)/python -m pytest -q -p no:xdist tests/test_preflight.py tests/test_sglang_launch.py

demo: $(STAMP) $(TRAIN_STAMP) $(SERVE_STAMP)
	$(BIN)/ktflow demo

# The documentation site (mkdocs.yml, docs/) into site/; the recipe and CLI references and the figures are
# generated while it builds (docs/gen_reference.py). --strict: a broken link or a page left out of nav fails.
# NO_MKDOCS_2_WARNING: Material 9.7+ prints a banner about its end of life (May 2027) at every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Debian's chromium and its driver for the browser test (tests/test_ui.py); apt only when absent.
browser:
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium chromium-driver; }

# Debian's OpenSSH server for the artifact-store tests (a real SFTP server: tests/sftp_server.py); apt only when absent.
sshd:
	@test -x /usr/sbin/sshd || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends openssh-server; }

# The linter first (seconds): pyflakes, pycodestyle and import order as pyproject.toml's [tool.ruff] sets them.
test: $(STAMP) $(TRAIN_STAMP) $(LEGACY_STAMP) $(SERVE_STAMP) $(KT_STAMP) browser sshd
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist load $(PYTEST_ARGS)

# Re-resolve the orchestrator pins from pyproject's ranges (needs network to the index).
lock:
	rm -rf /tmp/ktflow-lock && $(PYTHON) -m venv /tmp/ktflow-lock
	/tmp/ktflow-lock/bin/pip install -q '.[dev]' 'fastapi==0.150.0'
	{ echo "# Exact versions for the orchestrator env (.venv). Regenerate: make lock (see Makefile)."; \
	  echo "# torch 2.13.0 resolves to the local CPU build where the machine has one (pip find-links)."; \
	  echo "# fastapi is held at 0.150.0: prefect 3.8.8's server breaks on newer ones (Body(min_items) removed in"; \
	  echo "# 0.155; 0.154 answers the client's artifact filters with 422)."; \
	  /tmp/ktflow-lock/bin/pip freeze --exclude-editable | grep -v '^ktflow' | sed 's/+cpu$$//'; } > constraints/orchestrator.txt

lock-train: $(STAMP)
	rm -rf /tmp/ktflow-lock-train && $(PYTHON) -m venv /tmp/ktflow-lock-train
	$(UV) --python /tmp/ktflow-lock-train/bin/python $(TRAIN_PKGS)
	{ echo "# Exact versions for the training toolchain (.venv-train): LlamaFactory 0.9.5 on CPU."; \
	  echo "# torch/torchvision/torchaudio must match (LlamaFactory hard-imports torchaudio). Regenerate: make lock-train."; \
	  /tmp/ktflow-lock-train/bin/pip freeze | sed 's/+cpu$$//'; } > constraints/train.txt

lock-serve: $(STAMP)
	{ echo "# Exact versions for the serving toolchain (.venv-serve): ktransformers[sglang] 0.7.2 (sglang-kt with its GPU"; \
	  echo "# dependencies, kt-kernel, the KT builds of sglang's kernels) and torch 2.9.1 (CUDA 12.8). Resolved by uv for"; \
	  echo "# CPython 3.11 on manylinux_2_35 x86-64 (installs on 3.12 too). Regenerate: make lock-serve."; \
	  printf '%s\n' $(SERVE_PKGS) | $(COMPILE) -; } > constraints/serve.txt.new
	mv constraints/serve.txt.new constraints/serve.txt

lock-kt-train: $(STAMP)
	{ echo "# Exact versions for the KT 0.7 training toolchain (.venv-kt-train): ktransformers[sft] 0.7.2 with the -kt forks"; \
	  echo "# of LlamaFactory/transformers/accelerate/peft/trl and torch 2.9.1 (CUDA 12.8). Resolved by uv for CPython 3.11"; \
	  echo "# on manylinux_2_35 x86-64 (installs on 3.12 too). Regenerate: make lock-kt-train."; \
	  printf '%s\n' $(KT_PKGS) | $(COMPILE) -; } > constraints/kt-train.txt.new
	mv constraints/kt-train.txt.new constraints/kt-train.txt

clean-env:
	rm -rf $(VENV) $(TRAIN_VENV) $(SERVE_VENV) $(KT_VENV) $(UV_CACHE_DIR)

endif
