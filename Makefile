# The README's two commands: `make demo` and `make test`. Each creates or refreshes .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` and the tiers (tests/conftest.py groups the tests by file);
# PYTEST_WORKERS=0 runs in one process
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))
# `make demo ARGS="trainer.max_steps=5 ..."`: key=value overrides for the demo's config. A bare
# key=value on make's command line is a make variable, never passed on: `demo` refuses a dotted one.
ARGS ?=
DOTTED_VARS := $(strip $(foreach v,$(.VARIABLES),$(if $(findstring command line,$(origin $(v))),$(if $(findstring .,$(v)),$(v)))))
ifneq ($(and $(filter demo,$(MAKECMDGOALS)),$(DOTTED_VARS)),)
$(error make demo $(firstword $(DOTTED_VARS))=$($(firstword $(DOTTED_VARS))): make takes key=value as a make variable and drops it; valid: make demo ARGS="$(foreach v,$(DOTTED_VARS),$(v)=$($(v)))")
endif
# Any other command-line variable this Makefile does not read (`make demo max_steps=5`, a key
# without its section) is refused too, with the key's full name looked up in configs/defaults.yaml.
MAKE_VARS := VENV PYTEST_ARGS PYTEST_WORKERS ARGS GPU_CHECK_ARGS EVIDENCE_ARGS
STRAY_VAR := $(firstword $(filter-out $(MAKE_VARS) $(DOTTED_VARS),$(foreach v,$(.VARIABLES),$(if $(findstring command line,$(origin $(v))),$(v)))))
ifneq ($(and $(filter demo,$(MAKECMDGOALS)),$(STRAY_VAR)),)
FULL_KEYS := $(shell awk -v k='$(STRAY_VAR)' 'match($$0, /^ */) { d = RLENGTH / 2; n = substr($$0, RLENGTH + 1); if (n ~ /^[A-Za-z_0-9]+:/) { split(n, a, ":"); p[d] = a[1]; if (a[1] == k) { s = p[0]; for (i = 1; i <= d; i++) s = s "." p[i]; print s } } }' configs/defaults.yaml)
ALTS := $(subst " make demo," or make demo,$(foreach k,$(FULL_KEYS),make demo ARGS="$(k)=$($(STRAY_VAR))"))
$(error make demo $(STRAY_VAR)=$($(STRAY_VAR)): not a variable of this Makefile, so make would drop it; valid: $(or $(ALTS),make demo ARGS="<section>.$(STRAY_VAR)=$($(STRAY_VAR))" with the key's full name from configs/defaults.yaml), or a Makefile variable ($(MAKE_VARS)))
endif

.PHONY: env demo test test-unit test-vllm test-e2e gpu-check lint format bench evidence clean

# The repository's own bytecode too: where PYTHONDONTWRITEBYTECODE is set (these machines), every
# worker process, CLI run and test process would otherwise compile verl/ again (about 1 s each).
env:
	@bash scripts/setup_env.sh
	@$(PY) -m compileall -q -j 0 verl patches tests benchmarks >/dev/null

demo: env
	@$(PY) -m verl.trainer.demo $(ARGS)

# (after the suite, one line on how fast the machine ran: benchmarks/machine_probe.py)
test: env
	$(PY) -m ruff check .
	VERL_MACHINE_PROBE=1 $(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-unit: env
	$(PY) -m pytest -q $(XDIST) -m "not vllm and not e2e and not gpu" $(PYTEST_ARGS)

test-vllm: env
	$(PY) -m pytest -q $(XDIST) -m vllm $(PYTEST_ARGS)

test-e2e: env
	$(PY) -m pytest -q $(XDIST) -m e2e $(PYTEST_ARGS)

# On a CUDA machine: the FSDP actor alone, the gpu test tier, a colocated 2-step guided run (MODEL_PATH, GUIDANCE_PATH)
# and the rollout benchmark, in one report (outputs/gpu_check/report.md; verl/tools/gpu_check.py).
gpu-check:
	@nvidia-smi -L >/dev/null 2>&1 || { echo "gpu-check: no NVIDIA GPU here (nvidia-smi -L fails); run it on a machine with one" >&2; exit 1; }
	@bash scripts/setup_env.sh
	$(PY) -m verl.tools.gpu_check $(GPU_CHECK_ARGS)

lint: env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: env
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: env
	$(PY) benchmarks/bench_core_algos.py
	$(PY) benchmarks/bench_actor.py

# Learning curves of every guidance recipe vs plain GRPO on the long-horizon embedded task, 3
# seeds (56 minutes on 2 cores, nothing else running; not part of `make test`; benchmarks/README.md).
# Background: nohup make evidence > evidence.log 2>&1 &   (EVIDENCE_ARGS='--task arithmetic': the old task)
evidence: env
	$(PY) benchmarks/evidence.py $(EVIDENCE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
