"""TRL's GRPOTrainer vs this project's plain GRPO: same draft, data, reward and knobs, on CPU.

One run trains both for N steps (a step: one generation batch of 64 prompts x 8 responses, then 2
optimizer updates of 256 completions), scores both final models with
`verl.tasks.embedded.greedy_accuracy` on the 500 held-out rows, and reports seconds per step and
the ratio TRL / ours. Ours is `python -m verl.trainer.main` on examples/grpo_guided.yaml with
guidance off; TRL (pinned below) runs in its own virtualenv, .cache/trl-venv, built on first use,
through benchmarks/_trl_grpo_worker.py. Writes <out>/trl_side_by_side.json and .md.

Usage:
    .venv/bin/python benchmarks/trl_side_by_side.py [--steps 20] [--seed 0] [--skip-install] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import reduce
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_stats import bootstrap_ratio  # noqa: E402
from verl.trainer.config import PPOConfig, load_config  # noqa: E402
from verl.trainer.core_algos.offpolicy import LOG_RATIO_CLAMP  # noqa: E402

TRL_VENV = ROOT / ".cache" / "trl-venv"
WORK = ROOT / ".cache" / "trl_side_by_side"
WORKER = ROOT / "benchmarks" / "_trl_grpo_worker.py"
# TRL 1.16.0 with the versions of this project's own env (its CPU torch wheel), so both sides run
# the same model code and kernels.
TRL_PINS = ("trl==1.16.0", "torch==2.13.0", "transformers==5.19.0", "accelerate==1.15.0",
            "datasets==5.2.0")  # fmt: skip


def ensure_trl_env(venv: Path = TRL_VENV, skip_install: bool = False) -> float | None:
    """Create `venv` with TRL_PINS unless its stamp already lists them; the install seconds, or None."""
    python, stamp = venv / "bin" / "python", venv / "trl-pins.json"
    stamped = stamp.exists() and json.loads(stamp.read_text()) == list(TRL_PINS)
    if skip_install or (python.exists() and stamped):
        if not python.exists():
            raise SystemExit(f"--skip-install, but {venv} has no python: run once without it")
        return None
    start = time.perf_counter()
    print(f"installing {' '.join(TRL_PINS)} into {venv} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *TRL_PINS], check=True)
    stamp.write_text(json.dumps(list(TRL_PINS)))
    return time.perf_counter() - start


MATCH_TRL = ("worker.actor.micro_batch_size_per_device_for_update=256",)
"""Ours set as TRL runs: each optimizer step's 256 completions in one forward (TRL's
per_device_train_batch_size with gradient_accumulation_steps 1), not the example's two of 128."""


def ours_args(
    steps: int, seed: int, run_dir: Path, staleness: int = 0, extra: Sequence[str] = ()
) -> list[str]:
    """The `verl.trainer.main` arguments of our plain GRPO run (asynchronous at `staleness` > 0),
    with the `extra` overrides last."""
    return [f"async_training.staleness={staleness}", f"config={ROOT / 'examples' / 'grpo_guided.yaml'}", "worker.rollout.offpolicy_guidance.enable=false",
            f"trainer.max_steps={steps}", f"trainer.val_freq={steps}", "trainer.val_before_train=true",
            "trainer.logger=[file]", f"trainer.save_checkpoint_path={run_dir}", "trainer.resume=none",
            f"data.seed={seed}", f"worker.rollout.seed={seed}", *MATCH_TRL, *extra]  # fmt: skip


def trl_config(cfg: PPOConfig, steps: int, seed: int, output_dir: str) -> dict:
    """GRPOConfig kwargs equal to our config's settings; ValueError where no TRL knob matches."""
    data, actor, rollout, algo = cfg.data, cfg.worker.actor, cfg.worker.rollout, cfg.algorithm
    loss = actor.policy_loss
    generation = data.rollout_batch_size * rollout.n
    checks = {"algorithm.adv_estimator must be grpo": algo.adv_estimator == "grpo",
              "worker.actor.policy_loss.loss_type must be ppo": loss.loss_type == "ppo",
              "worker.actor.policy_loss.loss_agg_mode must be token-mean": loss.loss_agg_mode == "token-mean",
              "the KL must be off (algorithm.disable_kl)": not cfg.uses_reference and not actor.use_kl_loss,
              "guidance must be off": not rollout.offpolicy_guidance.enable,
              "no chat template (data.apply_chat_template=false)": not data.apply_chat_template,
              "rollout batch x n must split into whole global batches": generation % actor.global_batch_size == 0,
              "constant learning rate without warm-up": actor.optim.min_lr_ratio is None and not (
                  actor.optim.lr_warmup_ratio if actor.optim.lr_warmup_steps is None else actor.optim.lr_warmup_steps)}  # fmt: skip
    failed = [what for what, ok in checks.items() if not ok]
    if failed:
        raise ValueError("cannot map to TRL: " + "; ".join(failed))
    updates = generation // actor.global_batch_size
    return dict(
        output_dir=output_dir, max_steps=steps * updates, num_generations=rollout.n,
        # one forward of a whole mini-batch (no accumulation): "bnpo" is then exactly our token-mean
        per_device_train_batch_size=actor.global_batch_size, gradient_accumulation_steps=1,
        steps_per_generation=updates, num_iterations=actor.ppo_epochs, shuffle_dataset=data.shuffle,
        max_completion_length=data.max_response_length, temperature=rollout.temperature,
        top_p=rollout.top_p, top_k=max(rollout.top_k, 0), use_vllm=False,
        loss_type="bnpo", beta=0.0, epsilon=loss.clip_ratio_low, epsilon_high=loss.clip_ratio_high,
        delta=loss.clip_ratio_dual, scale_rewards="group" if algo.norm_adv_by_std_in_grpo else "none",
        mask_truncated_completions=False, learning_rate=actor.optim.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=actor.optim.weight_decay, adam_beta1=actor.optim.betas[0],
        adam_beta2=actor.optim.betas[1], optim="adamw_torch", max_grad_norm=actor.max_grad_norm,
        gradient_checkpointing=actor.model.enable_gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=False, fp16=False, use_cpu=True,
        seed=seed, data_seed=seed, logging_steps=1, save_strategy="no", report_to="none",
        remove_unused_columns=False, disable_tqdm=True,
    )  # fmt: skip


MAPPING = (  # (our config keys, the GRPOConfig keys set from them)
    (("data.rollout_batch_size", "worker.rollout.n"), "generation_batch_size = per_device_train_batch_size x steps_per_generation"),
    (("worker.rollout.n",), "num_generations"),
    (("worker.actor.global_batch_size",), "per_device_train_batch_size, gradient_accumulation_steps=1"),
    (("worker.actor.ppo_epochs",), "num_iterations"),
    (("worker.actor.policy_loss.loss_agg_mode",), "loss_type=bnpo (token mean over the optimizer step's batch)"),
    (("worker.actor.policy_loss.clip_ratio_low", "worker.actor.policy_loss.clip_ratio_high"), "epsilon, epsilon_high"),
    (("worker.actor.policy_loss.clip_ratio_dual",), "delta (two-sided clip: the same loss and gradient as the dual clip)"),
    (("algorithm.disable_kl",), "beta=0"),
    (("algorithm.norm_adv_by_std_in_grpo",), "scale_rewards=group"),
    (("worker.rollout.temperature", "worker.rollout.top_p", "worker.rollout.top_k"), "temperature, top_p, top_k=0 (off)"),
    (("data.max_response_length",), "max_completion_length"),
    (("worker.actor.optim.lr", "worker.actor.optim.lr_warmup_steps"), "learning_rate, lr_scheduler_type=constant, warmup_steps=0"),
    (("worker.actor.optim.betas", "worker.actor.optim.weight_decay"), "adam_beta1, adam_beta2, weight_decay, optim=adamw_torch"),
    (("worker.actor.max_grad_norm",), "max_grad_norm"),
    (("worker.actor.model.enable_gradient_checkpointing",), "gradient_checkpointing, use_reentrant=False"),
    (("worker.rollout.dtype",), "bf16=False, fp16=False (float32 weights)"),
    (("data.shuffle", "data.seed", "worker.rollout.seed"), "shuffle_dataset, seed, data_seed: both samplers draw torch.randperm(9500) from a Generator seeded with S, so step k gets the same 64 prompts on both sides (checked against TRL 1.16's dataloader)"),
    (("data.apply_chat_template",), "a plain-text `prompt` column"),
    (("worker.reward.reward_function",), "reward_funcs=[exact_match] in the worker: the same rule (stripped completion == answer)"),
    (("data.max_prompt_length",), "no knob in TRL 1.16; no prompt is over 6 tokens, so neither side cuts one"),
    (("algorithm.tis_level",), "no rollout correction: vllm_importance_sampling_correction acts only with use_vllm"),
)  # fmt: skip


def mapping(cfg: PPOConfig) -> list[tuple[str, str, str]]:
    """(our keys, their values, the TRL keys) for every row of MAPPING."""
    return [(", ".join(keys), ", ".join(str(reduce(getattr, k.split("."), cfg)) for k in keys), trl)
            for keys, trl in MAPPING]  # fmt: skip


PROXIMAL_WORDS = {
    "recompute": "recomputes it in a separate forward before the update (algorithm.proximal=recompute)",
    "rollout": "takes the draft engine's log-probs of the sampled tokens (algorithm.proximal=rollout)",
}


def _micro_words(cfg: PPOConfig) -> str:
    micro, mini = (
        cfg.worker.actor.micro_batch_size_per_device_for_update,
        cfg.worker.actor.global_batch_size,
    )
    if micro >= mini:
        return f"updates each mini-batch of {mini} in one forward"
    return f"updates in micro-batches of {micro} with gradient accumulation"


def differences(cfg: PPOConfig) -> list[str]:
    """Every setting the two runs cannot share, and why."""
    return [
        "generation: ours samples with the vLLM CPU engine, TRL with transformers `generate` (use_vllm=False; no vLLM in its env): the same distribution (temperature 1, no top-p/top-k), other random streams",
        "mini-batches: ours splits the 512 completions in rollout order (whole groups, first 32 prompts then the next 32); TRL shuffles the 512 before splitting into 2 x 256; advantages are computed over all 512 first on both sides",
        f"advantage epsilon: ours (R - mean)/(std + {cfg.algorithm.adv_epsilon:g}), TRL hard-codes std + 1e-4 (no knob); both use the unbiased group std",
        "weight decay: ours decays every parameter; the transformers Trainer under TRL exempts biases and norm weights",
        f"micro-batching: ours {_micro_words(cfg)}, padding-free (sequences packed into rows); TRL in one padded forward of {cfg.worker.actor.global_batch_size} (so loss_type=bnpo equals our token-mean exactly): same gradient up to rounding, other speed and memory",
        "entropy: TRL computes the per-token entropy in every loss forward (for logging); ours only when entropy_coeff != 0",
        f"log ratio: ours clamps log(pi/pi_old) to +-{LOG_RATIO_CLAMP:g} before exp; TRL does not (never reached here)",
        "non-finite gradient norm: ours skips that optimizer step; TRL steps",
        f"π_old: ours {PROXIMAL_WORDS[cfg.algorithm.proximal]}; TRL at num_iterations=1 uses the loss forward's own log-probs, detached (ratio 1 on every mini-batch)",
        "processes and threads: ours runs Ray (driver, one actor rank, its module unwrapped at one rank, whose torch threads split the cores, a vLLM engine) and copies the weights to vLLM every step (inside the step time); TRL is one process with torch's default threads (all cores)",
        "validation: ours validates at step 0 and N with vLLM greedy decoding (outside perf/time_per_step); TRL runs no evaluation; both final models are also scored afterwards by greedy_accuracy in this env",
        "steps: TRL counts optimizer steps, so N of our steps = max_steps 2N there (one generation per 2 optimizer steps)",
        "timing: ours = mean of perf/time_per_step (start-up and validation excluded); TRL = (last optimizer step's end - on_train_begin) / N, start-up and saving excluded (train_runtime, which includes the trainer loop's own set-up, is in the JSON too)",
    ]  # fmt: skip


def summarize_ours(rows: list[dict], steps: int) -> dict:
    """Seconds per step and validation accuracy at 0 and `steps` from our experiment log rows."""
    times = [r["perf/time_per_step"] for r in rows if "perf/time_per_step" in r]
    val = {r["step"]: r["val/reward_score"] for r in rows if "val/reward_score" in r}
    timing = {k: statistics.fmean(r[k] for r in rows if k in r) for k in rows[-1] if k.startswith("timing_s/")}  # fmt: skip
    return {"s_per_step": statistics.fmean(times), "step_times": times, "timing_s_mean": timing,
            "train_reward": [r["critic/score/mean"] for r in rows if "critic/score/mean" in r],
            "val_accuracy_start": val.get(0), "val_accuracy_end": val.get(steps)}  # fmt: skip


def pooled(runs: list[dict]) -> dict:
    """One side's runs as one: the last run's fields, every run's step times pooled, their mean
    as `s_per_step`, and each run's own mean in `runs_s_per_step`."""
    times = [t for r in runs for t in r["step_times"]]
    return {**runs[-1], "step_times": times, "s_per_step": statistics.fmean(times),
            "runs_s_per_step": [r["s_per_step"] for r in runs]}  # fmt: skip


def summarize_trl(result: dict, steps: int, updates: int) -> dict:
    """Seconds per step of ours (= `updates` optimizer steps) from the worker's step clock."""
    ends = result["step_ends"]
    if len(ends) != steps * updates:
        raise RuntimeError(f"TRL made {len(ends)} optimizer steps, expected {steps * updates}")
    marks = [result["train_begin"], *ends[updates - 1 :: updates]]
    times = [b - a for a, b in itertools.pairwise(marks)]
    generation = result.get("generate_and_score_s") or []
    return {"s_per_step": (ends[-1] - result["train_begin"]) / steps, "step_times": times,
            "train_runtime_s_per_step": result["train_runtime_s"] / steps, "setup_s": result["setup_s"],
            "generate_and_score_s_mean": statistics.fmean(generation) if generation else None}  # fmt: skip


def alternating(r: dict) -> str:
    """The ratio's interval and the runs behind it, for a result of alternating repeats."""
    if "ratio_ci95" not in r:
        return ""
    (low, high), o, t = r["ratio_ci95"], r["ours"], r["trl"]
    each = lambda x: ", ".join(f"{v:.2f}" for v in x["runs_s_per_step"])  # noqa: E731
    return (f" (95 % bootstrap CI {low:.2f}-{high:.2f}; {r['repeats']} alternating runs of each side, "
            f"ours at staleness {r['staleness']}: ours {each(o)} s, TRL {each(t)} s per step)")  # fmt: skip


def report_md(r: dict) -> str:
    """The markdown report of a result dict (see main)."""
    o, t = r["ours"], r["trl"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    def rewards(x: list[float]) -> str:
        return " ".join(f"{v:.2f}" for v in x)

    install = "reused" if r["trl_install_s"] is None else f"installed in {r['trl_install_s']:.0f} s"

    lines = [f"# TRL GRPOTrainer vs ours (plain GRPO), {r['steps']} steps, seed {r['seed']}", "",
             f"One step = {r['step_definition']}.", "",
             "| | ours | TRL |", "| --- | --- | --- |",
             f"| seconds per step | {o['s_per_step']:.2f} | {t['s_per_step']:.2f} |",
             f"| greedy accuracy at step 0 | {pct(r['accuracy_start'])} | {pct(r['accuracy_start'])} |",
             f"| greedy accuracy after {r['steps']} steps | {pct(o['accuracy_end'])} | {pct(t['accuracy_end'])} |",
             f"| our validation (vLLM greedy) at 0 / {r['steps']} | {pct(o['val_accuracy_start'])} / {pct(o['val_accuracy_end'])} | - |",
             f"| mean training reward, step by step | {rewards(o['train_reward'])} | {rewards(t['train_reward'])} |",
             "", f"Seconds per step, TRL / ours: **{r['ratio_s_per_step']:.2f}x**{alternating(r)} (TRL's own "
             f"train_runtime / N: {t['train_runtime_s_per_step']:.2f} s).", "",
             "Accuracy: `verl.tasks.embedded.greedy_accuracy` on the 500 test rows for the draft and both final models.",
             f"TRL env ({install}): {', '.join(f'{k} {v}' for k, v in r['trl_versions'].items())}; "
             f"TRL ran with {r['trl_torch_threads']} torch threads on {r['cpu_count']} CPUs; 1-minute load "
             f"average {r['load_avg_1min'][0]:.2f} at the start, {r['load_avg_1min'][1]:.2f} at the end.", "",
             "## Settings: ours -> TRL", "", "| ours | TRL GRPOConfig |", "| --- | --- |",
             *(f"| `{a}` = {v} | {b} |" for a, v, b in r["mapping"]), "",
             "## What differs, and why", "", *(f"- differs: {d}" for d in r["differences"]), ""]  # fmt: skip
    return "\n".join(lines)


def run_logged(cmd: list[str], log: Path, env: dict | None = None) -> None:
    """Run `cmd` in the repo root with its output in `log`; on failure, show the log's tail."""
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        sys.exit(f"{cmd[2]} failed (exit {rc}); the end of {log}:\n" + log.read_text()[-4000:])


def run_trl(work: Path, trl: dict, cfg: PPOConfig) -> dict:
    """GRPOTrainer in the TRL env through the worker, on our model and train rows; its result JSON."""
    from verl.tasks.embedded import load_embedded

    (work / "train.json").write_text(json.dumps(load_embedded(cfg.data.train_files)))
    spec = {"model": str(ROOT / cfg.worker.actor.model.model_path), "train_rows": str(work / "train.json"), "config": trl,
            "model_out": str(work / "trl-model"), "result": str(work / "trl-result.json")}  # fmt: skip
    (work / "trl-spec.json").write_text(json.dumps(spec, indent=1))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(TRL_VENV / "bin" / "python"), str(WORKER), str(work / "trl-spec.json")]
    run_logged(cmd, work / "trl.log", env)
    return json.loads((work / "trl-result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="our steps (TRL: 2x optimizer steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side")
    parser.add_argument("--staleness", type=int, default=0, help="ours: async_training.staleness")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of ours (repeatable), e.g. algorithm.proximal=rollout")  # fmt: skip
    parser.add_argument("--skip-install", action="store_true", help="use .cache/trl-venv as it is")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    install_s = ensure_trl_env(skip_install=args.skip_install)
    print("TRL env:", "reused" if install_s is None else f"installed in {install_s:.0f} s")
    work, load_start = WORK / f"s{args.seed}-n{args.steps}", os.getloadavg()[0]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    overrides = ours_args(args.steps, args.seed, work / "ours-0", args.staleness, args.set)
    cfg = load_config(overrides)
    trl = trl_config(cfg, args.steps, args.seed, str(work / "trl"))
    runs = {"ours": [], "trl": []}
    for repeat in range(args.repeats):  # ours, TRL, ours, TRL, ...: load drift falls on both
        ours_dir = work / f"ours-{repeat}"
        print(
            f"ours #{repeat}: {args.steps} steps of plain GRPO (staleness {args.staleness}) ...",
            flush=True,
        )
        run_logged([sys.executable, "-m", "verl.trainer.main", *ours_args(args.steps, args.seed, ours_dir, args.staleness, args.set)],
                   work / f"ours-{repeat}.log")  # fmt: skip
        log = (ours_dir / "experiment_log.jsonl").read_text().splitlines()
        runs["ours"].append(summarize_ours([json.loads(x) for x in log if x.strip()], args.steps))
        print(f"ours #{repeat}: {runs['ours'][-1]['s_per_step']:.2f} s/step", flush=True)
        print(f"TRL #{repeat}: {trl['max_steps']} optimizer steps of GRPOTrainer ...", flush=True)
        trl_result = run_trl(work, trl, cfg)
        runs["trl"].append(summarize_trl(trl_result, args.steps, trl["steps_per_generation"]))
        print(f"TRL #{repeat}: {runs['trl'][-1]['s_per_step']:.2f} s/step", flush=True)
    ours, trl_side = pooled(runs["ours"]), pooled(runs["trl"])
    ratio = bootstrap_ratio(trl_side["step_times"], ours["step_times"])
    print(
        f"TRL / ours: {ratio[0]:.2f}x (95 % CI {ratio[1]:.2f}-{ratio[2]:.2f}); scoring both ...",
        flush=True,
    )

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.tasks.embedded import greedy_accuracy, load_embedded

    torch.set_num_threads(os.cpu_count() or 1)
    draft = ROOT / cfg.worker.actor.model.model_path
    test, tokenizer = load_embedded(cfg.data.val_files), AutoTokenizer.from_pretrained(draft)

    def score(path: Path) -> float:
        return greedy_accuracy(AutoModelForCausalLM.from_pretrained(path).eval(), test, tokenizer)

    ours["accuracy_end"] = score(
        work / f"ours-{args.repeats - 1}" / f"global_step_{args.steps}" / "actor" / "hf"
    )
    trl_side["accuracy_end"] = score(work / "trl-model")
    trl_side["train_reward"] = [h["reward"] for h in trl_result["log_history"] if "reward" in h]
    prompts, n, updates = (
        cfg.data.rollout_batch_size,
        cfg.worker.rollout.n,
        trl["steps_per_generation"],
    )
    result = {
        "steps": args.steps, "seed": args.seed, "cpu_count": os.cpu_count(), "load_avg_1min": [load_start, os.getloadavg()[0]],
        "step_definition": f"{prompts} prompts x {n} responses = {prompts * n} completions, then {updates} optimizer "
        f"updates of {trl['per_device_train_batch_size']} (TRL: {updates} optimizer steps)",
        "accuracy_start": score(draft), "ours": ours, "trl": trl_side,
        "ratio_s_per_step": ratio[0], "ratio_ci95": list(ratio[1:]), "repeats": args.repeats,
        "staleness": args.staleness, "ours_overrides": args.set,
        "trl_install_s": install_s, "trl_versions": trl_result["versions"], "trl_torch_threads": trl_result["torch_threads"],
        "trl_config": trl, "trl_resolved": trl_result["resolved"], "mapping": mapping(cfg), "differences": differences(cfg),
        "trl_log_history": trl_result["log_history"],
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trl_side_by_side.json").write_text(json.dumps(result, indent=1, default=str))
    md = report_md(result)
    (args.out / "trl_side_by_side.md").write_text(md)
    print("\n".join(md.splitlines()[2:11]))
    print(f"wrote {args.out / 'trl_side_by_side.json'} and .md")


if __name__ == "__main__":
    main()
