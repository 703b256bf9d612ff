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

# The serving toolchain: kt-kernel (its converters and CPU kernels) pins torch 2.9.1.
SERVE_VENV := .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.ktflow-installed
SERVE_PKGS := kt-kernel==0.7.2 torch==2.9.1
# The KT 0.7 training toolchain (LlamaFactory-kt and the -kt forks): on this CPU box it is used to
# check rendered KT configs with LlamaFactory-kt's own parser and kt-kernel's own KTConfig.
KT_VENV := .venv-kt-train
KT_STAMP := $(KT_VENV)/.ktflow-installed
KT_PKGS := 'ktransformers[sft]==0.7.2' torch==2.9.1 torchaudio==2.9.1

.PHONY: demo test docs env train-env serve-env kt-train-env browser sshd lock lock-train lock-serve lock-kt-train clean-env

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

$(SERVE_STAMP): constraints/serve.txt constraints/sglang-nodeps.txt | $(STAMP)
	@test -x $(SERVE_VENV)/bin/python || $(PYTHON) -m venv $(SERVE_VENV)
	$(UV) --python $(SERVE_VENV)/bin/python -c constraints/serve.txt $(SERVE_PKGS)
	# sglang-kt beside kt-kernel without its GPU-only dependencies: enough for its argument parser.
	$(UV) --python $(SERVE_VENV)/bin/python --no-deps -r constraints/sglang-nodeps.txt
	@touch $@

$(KT_STAMP): constraints/kt-train.txt | $(STAMP)
	@test -x $(KT_VENV)/bin/python || $(PYTHON) -m venv $(KT_VENV)
	$(UV) --python $(KT_VENV)/bin/python -c constraints/kt-train.txt $(KT_PKGS)
	@touch $@

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
	rm -rf /tmp/ktflow-lock-serve && $(PYTHON) -m venv /tmp/ktflow-lock-serve
	$(UV) --python /tmp/ktflow-lock-serve/bin/python $(SERVE_PKGS)
	{ echo "# Exact versions for the serving toolchain (.venv-serve): kt-kernel 0.7.2 pins torch 2.9.1."; \
	  echo "# Regenerate: make lock-serve."; \
	  /tmp/ktflow-lock-serve/bin/pip freeze | sed 's/+cpu$$//'; } > constraints/serve.txt

lock-kt-train: $(STAMP)
	rm -rf /tmp/ktflow-lock-kt && $(PYTHON) -m venv /tmp/ktflow-lock-kt
	$(UV) --python /tmp/ktflow-lock-kt/bin/python $(KT_PKGS)
	{ echo "# Exact versions for the KT 0.7 training toolchain (.venv-kt-train): ktransformers[sft] 0.7.2 with"; \
	  echo "# the -kt forks of LlamaFactory/transformers/accelerate/peft/trl and torch 2.9.1. Regenerate: make lock-kt-train."; \
	  /tmp/ktflow-lock-kt/bin/pip freeze | sed 's/+cpu$$//'; } > constraints/kt-train.txt

clean-env:
	rm -rf $(VENV) $(TRAIN_VENV) $(SERVE_VENV) $(KT_VENV) $(UV_CACHE_DIR)

endif
