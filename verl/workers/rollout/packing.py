"""The rollout's batches in and out: prompts read from a padded `DataProto`, generated sequences
packed into EasyR1's layout (prompts left-padded to `prompt_length`, responses right-padded to
`response_length`) with the guidance's tensors, and the call's counters as `meta_info`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.core_algos.guidance import LOG_PROB_FLOOR, guidance_tensors
from verl.workers.rollout.config import OffPolicyGuidanceConfig, RolloutConfig
from verl.workers.rollout.speculative import GuidedSequence, RoundStats


def unpad_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The token ids of each prompt row (B, P) where its attention mask is set."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask, strict=True)]


def padded(lists: list, width: int, fill, dtype, left: bool = False) -> torch.Tensor:
    """Lists of values as (len(lists), width) rows, left-aligned with `fill` after them (right-
    aligned with `left`): one numpy scatter of the concatenated values, not a tensor per row."""
    lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
    out = np.full((len(lists), width), fill, dtype=dtype)
    total = int(lengths.sum())
    if total:
        flat = np.fromiter(chain.from_iterable(lists), dtype=dtype, count=total)
        rows = np.repeat(np.arange(len(lists)), lengths)
        cols = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[rows, cols + (np.repeat(width - lengths, lengths) if left else 0)] = flat
    return torch.from_numpy(out)


def _padded_rows(
    prompts: list[list[int]],
    seqs: list[GuidedSequence],
    p_len: int,
    r_len: int,
    pad: int,
    lam: float,
) -> dict[str, torch.Tensor]:
    """Per-sequence lists as padded tensors: prompts (B, P) left-padded, and per response token
    (B, T): ids, mask, log p (floored), log q, log q̃, λ'_t, λ_t, the draft's entropy, off-policy."""
    f32 = np.float32
    p_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    r_lengths = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long)
    return {
        "prompts": padded(prompts, p_len, pad, np.int64, left=True),
        "prompt_mask": (torch.arange(p_len) >= p_len - p_lengths[:, None]).long(),
        "responses": padded([s.tokens for s in seqs], r_len, pad, np.int64),
        "response_mask": (torch.arange(r_len) < r_lengths[:, None]).long(),
        "draft_lp": padded([s.draft_log_probs for s in seqs], r_len, 0.0, f32).clamp(min=LOG_PROB_FLOOR),
        # -inf: q = 0 after processing; NaN: not reported
        "guide_lp": padded([s.guidance_log_probs for s in seqs], r_len, 0.0, f32),
        # log q̃ of the sampled target (speculative rounds; else log q)
        "target_lp": padded([s.target_log_probs or s.guidance_log_probs for s in seqs], r_len, 0.0, f32),
        # λ'_t (the target's weight), λ_t as set and the draft's H_t (speculative rounds; else
        # the call's λ, NaN)
        "lam_t": padded([s.lam for s in seqs], r_len, lam, np.float64),
        "strength_t": padded([s.strength for s in seqs], r_len, lam, np.float64),
        "entropy": padded([s.draft_entropy if s.lam else [] for s in seqs], r_len, np.nan, f32),
        "off": padded([s.offpolicy for s in seqs], r_len, False, np.bool_),
    }  # fmt: skip


def to_dataproto(
    config: RolloutConfig,
    pad_token_id: int,
    num_logprobs: int,
    prompts: list[list[int]],
    seqs: list[GuidedSequence],
    lam: float,
    guided: np.ndarray,
) -> DataProto:
    """The sequences (B) in EasyR1's layout: `prompts`, `responses`, `input_ids`,
    `attention_mask`, `position_ids`, `response_mask`, `rollout_log_probs` (the draft's); with
    guidance, `guidance_tensors`' (behavior log-probs, off-policy and missing masks), the
    per-token λ_t and draft entropy, `guided_responses` (`guided`, (B,)) and, with `keep_topk`,
    the guidance's top-K rows (`num_logprobs` columns)."""
    guidance = config.offpolicy_guidance
    r_len = config.response_length
    rows = _padded_rows(prompts, seqs, config.prompt_length, r_len, pad_token_id, lam)
    prompt_t, resp, resp_mask = rows["prompts"], rows["responses"], rows["response_mask"]
    draft_lp, lam_t = rows["draft_lp"], rows["lam_t"]
    attention = torch.cat([rows["prompt_mask"], resp_mask], dim=1)
    tensors = {
        "prompts": prompt_t,
        "responses": resp,
        "input_ids": torch.cat([prompt_t, resp], dim=1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0) * attention,
        "response_mask": resp_mask.float(),
        "rollout_log_probs": draft_lp * resp_mask,
    }
    if guidance.enable and guidance.keep_topk:
        tensors.update(_topk_tensors(seqs, r_len, num_logprobs))
    if guidance.enable:
        tensors.update(guidance_part(guidance, draft_lp, rows["guide_lp"], rows["target_lp"],
                                     rows["off"], resp_mask, lam_t, rows["entropy"], lam, guided,
                                     rows["strength_t"]))  # fmt: skip
    return DataProto.from_dict(tensors)


def guidance_part(
    guidance: OffPolicyGuidanceConfig,
    draft_lp: torch.Tensor,
    guide_lp: torch.Tensor,
    target_lp: torch.Tensor,
    off: torch.Tensor,
    response_mask: torch.Tensor,
    lam_t: torch.Tensor,
    entropy: torch.Tensor,
    lam: float,
    guided: np.ndarray,
    strength_t: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """A guided batch's tensors from its per-token (B, T) log p, log q, log q̃, off-policy flags,
    λ'_t and draft entropies: `guidance_tensors`' (μ and the masks; λ'_t per token only where it
    differs from the step's λ on some response token: a gate, a guided subset, a top-K target),
    `guidance_lam` (λ'_t, the guidance's weight in the sampled target), `guidance_strength`
    (`strength_t`, λ_t as set, before a top-K target scales it), `draft_entropy` and
    `guided_responses` (`guided`, (B,))."""
    per_token = bool((lam_t[response_mask.bool()] != lam).any())
    out = guidance_tensors(draft_lp, guide_lp, off, response_mask, lam_t if per_token else lam,
                           guidance.mode, guidance.behavior, target_lp)  # fmt: skip
    out.update(guidance_lam=(lam_t * response_mask).float(),
               guidance_strength=(strength_t * response_mask).float(), draft_entropy=entropy,
               guided_responses=torch.from_numpy(guided))  # fmt: skip
    return out


def _topk_tensors(seqs: list[GuidedSequence], width: int, k: int) -> dict[str, torch.Tensor]:
    """`guidance_topk_ids` (B, T, K) and `guidance_topk_log_probs` (B, T, K) from the rows the
    sequences kept; padding and sequences without rows read id 0 and the floor."""
    ids = torch.zeros(len(seqs), width, k, dtype=torch.long)
    values = torch.full((len(seqs), width, k), LOG_PROB_FLOOR)
    for i, seq in enumerate(seqs):
        if seq.guidance_topk is not None:
            n = len(seq.guidance_topk[0])
            ids[i, :n] = torch.from_numpy(seq.guidance_topk[0])
            values[i, :n] = torch.from_numpy(seq.guidance_topk[1]).float().clamp(min=LOG_PROB_FLOOR)
    return {"guidance_topk_ids": ids, "guidance_topk_log_probs": values}


@dataclass
class Counters:
    """Guidance work of one `generate_sequences` call, reported in meta_info."""

    computed: int = 0
    submitted: int = 0
    tail_mass: list[np.ndarray] = field(default_factory=list)
    lookups: int = 0  # draft rows looked up at guidance tokens its top-K did not list

    def meta(self, stats: RoundStats | None, out: DataProto, lam: float, seqs: list) -> dict:
        emitted = int(out.batch["response_mask"].sum())
        meta = {"lam": lam, "emitted_tokens": emitted, "guidance_tokens_computed": self.computed,
                "guidance_tokens_submitted": self.submitted, "draft_lookups": self.lookups}  # fmt: skip
        if stats is not None:  # speculative rounds ran: TV(target, q_λ) per emitted token
            tv = [t for s in seqs for t in s.target_tv]
            meta["target_tv"] = float(np.mean(tv)) if tv else 0.0
            meta.update(accept_rate=stats.accept_rate, rounds=stats.rounds, sequence_rounds=stats.sequence_rounds,
                        proposed_tokens=stats.proposed,
                        accepted_tokens=stats.accepted, bonus_tokens=stats.bonus,
                        guidance_tokens_per_emitted=self.computed / max(emitted, 1))  # fmt: skip
        if self.tail_mass:
            rows = np.concatenate(self.tail_mass)
            meta.update(topk_tail_mass=float(rows.mean()), topk_rows=len(rows))
        return meta
