"""The rollout's generation modes, a registry of strategies (verl's register pattern).

`generate_sequences` picks one per call (`pick_mode`) and runs it on the call's context and
`Job`; each returns the sequences (`Generated`), which `packing.to_dataproto` lays out:
- "draft_only": the draft engine alone (guidance off, or a call without it, e.g. validation);
- "mix": the first `mix_num_samples` responses of each prompt sampled whole by the guidance;
- "teacher_only_prefill": λ = 0 by prefill, the draft samples, the guidance scores each
  response in one prefill (`teacher_scoring: prefill`);
- "speculative": speculative rounds toward q_λ on both engines (`speculative_mode.py`);
- "multi_turn", "multi_turn_speculative", "multi_turn_prefill": tool-using episodes, the
  multi-turn forms of draft_only, speculative and teacher_only_prefill, picked whenever
  `multi_turn.enable` (validation included); `multi_turn_mode.py` defines them and registers
  them here when it is imported (the rollout imports it).

A mode is a function of the call's `context.RolloutContext` (the engines, the call's sampling
settings and parameters, its counters, the rollout's wave numbers) and its `Job`; the modes never
import the rollout that calls them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from verl.trainer.core_algos.guidance import LAM_GATES
from verl.trainer.core_algos.guide_when import prefix_lengths
from verl.utils.registry import Registry
from verl.utils.vision import ImagePrompt, engine_request
from verl.workers.rollout.config import OffPolicyGuidanceConfig
from verl.workers.rollout.context import RolloutContext
from verl.workers.rollout.speculative import GuidedSequence, ListedRows, RoundStats
from verl.workers.rollout.speculative_mode import speculative_waves
from verl.workers.rollout.vllm_sessions import sampled_log_probs


@dataclass
class Job:
    """One `generate_sequences` call as a mode sees it."""

    prompts: list[list[int]]
    """The B sequences' prompts: each prompt repeated n times, row-major by prompt."""
    n: int
    """Responses per prompt."""
    seeds: np.ndarray
    """(B, 2) per sequence: its engine sampling seed, its acceptance draws' seed."""
    lam: float
    """The step's λ (0.0 without guidance)."""
    meta: dict
    """The batch's meta_info (e.g. `entropy_threshold`)."""
    images: list[ImagePrompt | None] | None = None
    """Per sequence its prompt's images as the engines open them (None: text), or None for a
    text batch; `prompts` hold the model's expanded tokens either way."""

    def engine_requests(self, rows: list[int] | None = None) -> list[dict]:
        """The prompts of `rows` (None: all) as an engine samples them whole (`engine_request`:
        with images, the raw prompt and its `multi_modal_data`)."""
        rows = range(len(self.prompts)) if rows is None else rows
        return [
            engine_request(self.prompts[i], self.images[i] if self.images else None) for i in rows
        ]


@dataclass
class Generated:
    """What a mode generated: the B sequences, its round counters (speculative rounds only) and
    which responses were sampled with λ > 0 ((B,) bool; None: none). The multi-turn mode gives
    its episodes already packed (`multi_turn.pack`) in `packed` instead of `seqs`."""

    seqs: list[GuidedSequence]
    stats: RoundStats | None = None
    guided: np.ndarray | None = None
    packed: dict | None = None


ModeFn = Callable[[RolloutContext, Job], Generated]
GENERATION_MODES: Registry[ModeFn] = Registry("generation mode")


def guided_per_prompt(guidance: OffPolicyGuidanceConfig, meta: dict, n: int) -> int:
    """How many of each prompt's n responses are guided: the call's `guided_per_prompt` (the
    trainer's two stages of `guide_when: group_fails`), else `mix_num_samples` in mix mode and
    `guided_samples` (None: all n) in speculative mode; at most n."""
    if "guided_per_prompt" in meta:
        return min(int(meta["guided_per_prompt"]), n)
    if guidance.mode == "mix":
        return min(guidance.mix_num_samples, n)
    return n if guidance.guided_samples is None else min(guidance.guided_samples, n)


def prefix_fraction(guidance: OffPolicyGuidanceConfig, meta: dict) -> float:
    """The call's teacher-prefix fraction: the trainer's scheduled value (`step_prefix`), else
    the configured `prefix_fraction`."""
    return float(meta.get("prefix_fraction", guidance.prefix_fraction))


def pick_mode(guidance: OffPolicyGuidanceConfig, meta: dict, n: int) -> tuple[str, float]:
    """The call's mode and λ: the draft alone without guidance (or when the call says
    `guidance: False`, e.g. validation), else by `guidance.mode`, with nothing to guide (λ = 0
    and no teacher prefix, or no guided response) scored by prefill under `teacher_scoring:
    prefill`."""
    if not guidance.enable or not meta.get("guidance", True):  # e.g. validation: the draft alone
        return "draft_only", 0.0
    # the step's λ as the trainer scheduled it (`ray_trainer.step_guidance`); a caller outside
    # the trainer (a test, a benchmark) that sends none gets the configured `lam`
    lam = float(meta.get("lam", guidance.lam))
    if guidance.mode == "mix":
        return "mix", lam
    nothing = lam == 0.0 and prefix_fraction(guidance, meta) == 0.0
    if (
        nothing or guided_per_prompt(guidance, meta, n) == 0
    ) and guidance.teacher_scoring == "prefill":
        return "teacher_only_prefill", lam  # scores only
    return "speculative", lam


def whole_response(
    tokens: list[int], log_probs: list[float], from_guidance: bool
) -> GuidedSequence:
    """A response sampled whole by one engine. The other engine never scored it: a draft
    response's q is not reported (NaN, `guidance_missing_mask`); a guidance response's p is not
    either, and its own log-probs stand in for `rollout_log_probs` (mix mode's behavior is the
    emitting engine's, so neither enters μ; see README_guidance.md)."""
    unscored = [float("nan")] * len(tokens)
    return GuidedSequence(tokens, [from_guidance] * len(tokens), log_probs,
                          log_probs if from_guidance else unscored, True)  # fmt: skip


def draft_responses(
    ctx: RolloutContext, requests: list[dict], seeds: np.ndarray
) -> list[GuidedSequence]:
    """Whole responses from the draft engine, one seed per request (`Job.engine_requests`;
    `whole_response`)."""
    params = [ctx.draft_params(ctx.max_tokens, 1, int(s)) for s in seeds]
    outputs = ctx.engines.draft.generate(
        requests,
        params,
        use_tqdm=not ctx.config.disable_tqdm,
    )
    return [whole_response(*sampled_log_probs(out.outputs[0]), False) for out in outputs]


@GENERATION_MODES.register("draft_only")
def draft_only(ctx: RolloutContext, job: Job) -> Generated:
    """Whole responses from the draft engine, one seed per sequence."""
    return Generated(draft_responses(ctx, job.engine_requests(), job.seeds[:, 0]))


@GENERATION_MODES.register("mix")
def mix(ctx: RolloutContext, job: Job) -> Generated:
    """The first `mix_num_samples` (`guided_per_prompt`) of each prompt's n samples from the
    guidance (its process samples them while the draft engine samples the rest here), the
    others from the draft."""
    n, seeds = job.n, job.seeds[:, 0]
    k = guided_per_prompt(ctx.config.offpolicy_guidance, job.meta, n)
    rows = {g: [i for i in range(len(job.prompts)) if (i % n < k) == g] for g in (True, False)}
    seqs: list = [None] * len(job.prompts)
    if rows[True]:
        processing = ctx.guidance_processing()
        params = [
            ctx.sampling_kwargs(ctx.max_tokens, 1, int(seeds[i]), **processing) for i in rows[True]
        ]
        ctx.engines.guidance.submit("generate", job.engine_requests(rows[True]), params)
    if rows[False]:
        draft = draft_responses(ctx, job.engine_requests(rows[False]), seeds[rows[False]])
        for i, seq in zip(rows[False], draft, strict=True):
            seqs[i] = seq
    if rows[True]:
        for i, (tokens, lps) in zip(rows[True], ctx.engines.guidance.result(), strict=True):
            seqs[i] = whole_response(tokens, lps, True)
    return Generated(seqs)


@GENERATION_MODES.register("teacher_only_prefill")
def teacher_only_prefill(ctx: RolloutContext, job: Job) -> Generated:
    """λ = 0 by prefill: the draft samples whole responses, then the guidance scores each in
    one prefill; on CPU each engine has every core while it works (the other idles)."""
    with ctx.cores_to("draft"):
        seqs = draft_responses(ctx, job.engine_requests(), job.seeds[:, 0])
    with ctx.cores_to("guidance"):
        teacher_prefill(ctx, job.prompts, seqs, job.images)
    return Generated(seqs)


def teacher_prefill(
    ctx: RolloutContext,
    prompts: list[list[int]],
    seqs: list[GuidedSequence],
    images: list[ImagePrompt | None] | None = None,
) -> None:
    """Score whole sampled sequences on the guidance engine, one prefill each (in waves its
    KV cache holds), and set their `guidance_log_probs` to its processed log q of every
    response token (column 0 of a prompt log-prob row is the scored token itself); `images`
    as `Job.images` (`prompts` then expanded)."""
    guidance = ctx.engines.guidance
    longest = max(len(p) + len(s.tokens) for p, s in zip(prompts, seqs, strict=True)) + 1
    size = guidance.call("capacity", longest)
    for start in range(0, len(seqs), size):
        wave = ctx.waves.next()
        part = range(start, min(start + size, len(seqs)))
        chunks = [(f"t{wave}-{i}", prompts[i] + seqs[i].tokens, 1, None) for i in part]
        if images is not None and any(images[i] for i in part):
            guidance.call("expect", {f"t{wave}-{i}": images[i] for i in part if images[i]})
        rows = [(len(prompts[i]) - 1, len(seqs[i].tokens)) for i in part]
        (ids, values), _, computed = guidance.call(
            "score", chunks, rows, ctx.num_logprobs, ctx.guidance_processing()
        )
        guidance.call("close")
        ctx.counters.computed += computed
        processed = ListedRows(ids, values)  # processed in the engine
        ctx.counters.tail_mass.append(processed.tail_mass())
        ends = np.cumsum([count for _, count in rows])[:-1]
        for i, values_i in zip(
            part, np.split(processed.log_probs[:, 0].astype(np.float64), ends), strict=True
        ):
            seqs[i].guidance_log_probs = values_i.tolist()
        if ctx.config.offpolicy_guidance.keep_topk:  # the rows, for a top-K forward KL
            ids_k, values_k = processed.topk()
            for i, a, b in zip(part, np.split(ids_k, ends), np.split(values_k, ends), strict=True):
                seqs[i].guidance_topk = (a, b)


@GENERATION_MODES.register("speculative")
def speculative(ctx: RolloutContext, job: Job) -> Generated:
    """Speculative guidance toward q_λ: the first `guided_samples` responses of each prompt
    guided, the others λ_t = 0 (the draft alone), with the gate `lam_gate` at the call's
    `entropy_threshold` τ (`speculative_mode.speculative_waves`)."""
    guidance = ctx.config.offpolicy_guidance
    guided, gate = guided_rows(guidance, job)
    prefix = prefix_lengths(prefix_fraction(guidance, job.meta), ctx.max_tokens,
                            guidance.prefix_draw, job.seeds[:, 1], guided)  # fmt: skip
    seqs, stats = speculative_waves(ctx, job.prompts, job.lam, job.seeds, guided, gate, prefix, job.images)  # fmt: skip
    return Generated(seqs, stats, guided)


def guided_rows(
    guidance: OffPolicyGuidanceConfig, job: Job
) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray] | None]:
    """Which of the job's B sequences are guided ((B,) bool: the first `guided_per_prompt` of
    each prompt's n, none at λ = 0 without a teacher prefix) and the per-position gate of λ
    (`lam_gate` with the call's `entropy_threshold` τ; None: λ_t = λ)."""
    subset = guided_per_prompt(guidance, job.meta, job.n)
    active = job.lam > 0.0 or prefix_fraction(guidance, job.meta) > 0.0
    guided = (np.arange(len(job.prompts)) % job.n < subset) & active
    if guidance.lam_gate == "none":
        return guided, None
    tau = float(job.meta.get("entropy_threshold", guidance.entropy_threshold))
    gate = LAM_GATES.get(guidance.lam_gate)
    return guided, lambda entropy: gate(entropy, tau)
