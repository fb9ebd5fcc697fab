"""Data-parallel PPO actor: log-probs (+ entropy, Σπ²) and the decoupled policy update.

Works on any Hugging Face causal LM, plain or wrapped with FSDP2 (`fully_shard`); the same code
runs on CPU (gloo) and GPU (nccl). Batches follow EasyR1's layout: `input_ids`,
`attention_mask`, `position_ids` of shape (B, P+T) (left-padded prompt, right-padded response),
`responses` and `response_mask` of shape (B, T). Only logits of valid response tokens are ever
materialised: the padded path keeps the last T+1 positions, the padding-free path packs the
micro-batch's valid tokens into rows without padding (position ids restart per sequence, which
transformers turns into a block-causal mask; one row per micro-batch under flash-attention, rows
of at most max(longest, min(hidden_size, 4 x longest)) tokens under sdpa/eager, whose attention
is dense over the row) and keeps exactly the predicting rows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from verl.protocol import DataProto
from verl.trainer.core_algos.distill import distill_loss, distill_topk_forward_loss
from verl.trainer.core_algos.kl import compute_mismatch_metrics, kl_penalty
from verl.trainer.core_algos.policy_loss import agg_loss, get_policy_loss_fn
from verl.trainer.core_algos.sum_pi_squared import softmax_statistics
from verl.utils import metric_names as M
from verl.utils.lora import hf_model
from verl.utils.vision import vision_token_ids
from verl.workers.actor.config import ActorConfig

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
VISION_KEY = "multi_modal_inputs"
"""Non-tensor column of a vision-language batch (EasyR1's name): per row a dict of the prompt's
`pixel_values` (N, D) and `image_grid_thw` (images, 3) from the model's processor ({} for a row
without images)."""
OPTIONAL_UPDATE_KEYS = (
    "behavior_log_probs",
    "importance_weights",
    "offpolicy_mask",
    "rollout_mask",
    "ref_log_probs",
)
ROW_SEQUENCES = 4
"""Under sdpa/eager a packed row holds at most this many longest sequences' worth of tokens
(and at most hidden_size, unless one sequence is longer): `_packed_row_budget`."""
MISMATCH_MASK_KEY = "mismatch_mask"
"""(B, T) tokens whose engine log-prob the update's first forward checks (`algorithm.proximal=rollout`:
no separate π_old forward exists); `rollout_log_probs` travels with it."""
DISTILL_KEYS = ("guidance_log_probs", "guidance_missing_mask")  # read when distill_coef > 0
TOPK_KEYS = ("guidance_topk_ids", "guidance_topk_log_probs")  # with distill_topk_forward


def _mismatch(seen: list[tuple], forced_threshold: float) -> dict[str, float]:
    """mismatch/* over the micro-batches `seen` (engine log-probs, the actor's, mask, offpolicy)."""
    engine, actor, mask, off = (
        None if any(c is None for c in col) else torch.cat(col) for col in zip(*seen, strict=True)
    )
    if not mask.any():
        return {}
    return compute_mismatch_metrics(engine, actor, mask, off, forced_threshold)


def _select(data: DataProto, keys) -> DataProto:
    """The tensors `keys` of `data`, and its images (`VISION_KEY`) where it has them."""
    vision = [VISION_KEY] if VISION_KEY in data.non_tensor_batch else []
    return data.select(list(keys), non_tensor_batch_keys=vision)


def _as_dict(micro: DataProto) -> dict:
    """A micro-batch as the forward takes it: its tensors, and its images as a list of dicts."""
    batch = dict(micro.batch.items())
    if VISION_KEY in micro.non_tensor_batch:
        batch[VISION_KEY] = list(micro.non_tensor_batch[VISION_KEY])
    return batch


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce_sum(value: float, device: torch.device) -> float:
    if _world()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item()


@contextmanager
def root_unsharded(module: nn.Module) -> Iterator[None]:
    """Keep an FSDP2 root's own parameters (embeddings, final norm, head) gathered inside the block."""
    unshard = getattr(module, "unshard", None)
    if unshard is None:
        yield
        return
    unshard()
    try:
        yield
    finally:
        module.reshard()


@contextmanager
def head_rows(module: nn.Module, rows: torch.Tensor) -> Iterator[None]:
    """Inside the block, `module`'s LM head (`get_output_embeddings()`) is applied only to `rows`,
    flat positions into its (R, W, H) input, and returns (1, len(rows), V) logits: a forward over
    several packed rows computes no logits that nothing reads (HF's `logits_to_keep` picks the
    same positions in every row). The model's own forward runs, with all its hooks (FSDP's)."""

    def pick(_: nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1])[rows].unsqueeze(0), *args[1:])

    handle = module.get_output_embeddings().register_forward_pre_hook(pick)
    try:
        yield
    finally:
        handle.remove()


def token_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    entropy: bool = False,
    sum_pi_squared: bool = False,
    chunk_size: int = 1024,
    topk_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token log π(label), and optionally entropy and Σπ², of (M, V) logits / temperature;
    with autograd on (the update) also log π at `topk_ids` (M, K) as `topk_log_probs`.

    With autograd off the work runs `chunk_size` rows at a time in float32, so the extra memory
    stays O(chunk_size·V); with autograd on (the update) it is one pass that keeps the graph.
    """
    if torch.is_grad_enabled():
        z = logits.float() / temperature
        lse = torch.logsumexp(z, dim=-1)
        out = {"log_probs": z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse}
        if entropy:  # -inf logits (ids left out) have π = 0: z taken as 0 there (no 0·inf)
            finite = z.masked_fill(torch.isinf(z), 0.0)
            out["entropy"] = lse - (torch.softmax(z, dim=-1) * finite).sum(-1)
        if topk_ids is not None:
            out["topk_log_probs"] = z.gather(-1, topk_ids) - lse.unsqueeze(-1)
        return out
    parts: dict[str, list[torch.Tensor]] = defaultdict(list)
    for start in range(0, logits.shape[0], chunk_size):
        z = logits[start : start + chunk_size].float() / temperature
        stats = softmax_statistics(z, entropy, sum_pi_squared)
        picked = z.gather(-1, labels[start : start + chunk_size].unsqueeze(-1)).squeeze(-1)
        parts["log_probs"].append(picked - stats.pop("lse"))
        for key, value in stats.items():
            parts[key].append(value)
    return {k: torch.cat(v) if v else logits.new_zeros(0) for k, v in parts.items()}


def balanced_partition(lengths: list[int], budget: int) -> list[list[int]]:
    """Split row indices into the fewest micro-batches whose token sums fit `budget`, balanced.

    k starts at its lower bound (one micro-batch per row longer than the budget, plus
    ceil(Σ other lengths / budget)); rows go longest-first to the lightest micro-batch (LPT
    scheduling); if one would overflow, k grows by one. A row longer than the budget gets a
    micro-batch of its own. Within a micro-batch rows keep their original order.
    """
    if not lengths:
        return []
    overlong = sum(1 for n in lengths if n > budget)
    k = max(1, overlong + math.ceil(sum(n for n in lengths if n <= budget) / budget))
    by_length = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    while True:
        loads, parts = [0] * k, [[] for _ in range(k)]
        for i in by_length:
            j = min(range(k), key=loads.__getitem__)
            if loads[j] and loads[j] + lengths[i] > budget:
                break
            loads[j] += lengths[i]
            parts[j].append(i)
        else:
            return [sorted(p) for p in parts if p]
        k += 1


class DataParallelPPOActor:
    """Computes log-probs and updates the policy; one instance per data-parallel rank."""

    def __init__(
        self,
        config: ActorConfig,
        actor_module: nn.Module,
        actor_optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
    ) -> None:
        self.config = config
        self.actor_module = actor_module
        self.actor_optimizer = actor_optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_config = config.policy_loss
        self.policy_loss_fn = get_policy_loss_fn(config.policy_loss.loss_type)
        self.packed_row_tokens: int | None = None
        """Padding-free: most tokens per packed row (None: `_packed_row_budget`'s rule)."""
        banned = vision_token_ids(getattr(hf_model(actor_module), "config", {}))
        self.banned = torch.tensor(banned, dtype=torch.long) if banned else None
        """A vision-language model's image markers: left out of π's log-softmax (logits -inf), as
        the engines leave them out of μ (`verl.utils.vision.vision_token_ids`)."""

    # ------------------------------------------------------------------ forward
    def _packed_row_budget(self, lengths: list[int]) -> int | None:
        """Most tokens in one packed row, or None (the whole micro-batch in one row).

        With flash-attention (varlen) a packed row costs what its sequences cost apart. sdpa and
        eager attend densely over the whole row under a block-causal mask, so one row of n tokens
        costs O(n²): 256 responses of 42 tokens packed into one row of 10752 spend ~19x more on
        attention than on the linear layers of a width-128 Qwen2 (MLP width 256, one KV head). Rows of at most
        max(longest, min(hidden_size, 4 x longest)) tokens bound that: dense attention over a row of L
        tokens costs about 4·L·d FLOPs per token and layer, against 2·(8-12)·d² for the layer's
        projections and MLP, so at L = d it adds about a fifth to a quarter. Short sequences
        stop at four longest sequences' worth: the demo's 12-token sequences in rows of 48
        instead of 256 took 0.84-0.86x the update's time (rows of one sequence, 1.0-1.4x: the
        per-row mask and picks cost more than the attention saved).
        `packed_row_tokens` (set on the instance) overrides the budget.
        """
        if self.packed_row_tokens is not None:
            return max(self.packed_row_tokens, max(lengths))
        config = getattr(self.actor_module, "config", None)
        if getattr(config, "_attn_implementation", None) == "flash_attention_2":
            return None
        hidden, longest = getattr(config, "hidden_size", None), max(lengths)
        return None if hidden is None else max(longest, min(int(hidden), ROW_SEQUENCES * longest))

    def _model_inputs(
        self, micro: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Model kwargs, and what picks the M positions predicting the valid response tokens.

        Padding-free: the micro-batch's valid tokens packed without padding into R rows (position
        ids restart per sequence, which transformers turns into a block-causal mask): one row when
        `_packed_row_budget` is None or everything fits it, else rows of at most that many tokens
        (sequences bin-packed by `balanced_partition`; a row's unused tail holds padding tokens
        whose positions restart at 0, a sequence of its own that nothing reads). The pick is a
        LongTensor of M flat positions into the (R, W) rows, in the row-major order of the
        micro-batch's valid response tokens. Padded: the (b, L) batch, and a bool mask over its
        (b, L) positions.
        """
        ids, attn, pos = micro["input_ids"], micro["attention_mask"], micro["position_ids"]
        resp_len = micro["responses"].shape[1]
        valid = micro["response_mask"].bool()
        if not self.config.padding_free:
            predicting = torch.zeros_like(attn, dtype=torch.bool)
            predicting[:, -resp_len - 1 : -1] = valid
            kwargs = {"input_ids": ids, "attention_mask": attn, "position_ids": pos}
            if VISION_KEY in micro:
                kwargs.update(self._vision_kwargs(micro, list(range(len(ids))), pos, attn.bool()))
            return kwargs, predicting
        keep = attn.bool()
        lengths = keep.sum(-1).tolist()
        budget = self._packed_row_budget(lengths)
        if budget is None or sum(lengths) <= budget:
            bins = [list(range(len(lengths)))]  # one row, in the micro-batch's order
        else:
            bins = balanced_partition(lengths, budget)
        totals = [sum(lengths[i] for i in members) for members in bins]
        width, starts = max(totals), [0] * len(lengths)
        for r, members in enumerate(bins):  # where each sequence starts in the flat (R·W) rows
            offset = r * width
            for i in members:
                starts[i], offset = offset, offset + lengths[i]
        place = torch.tensor(starts, device=ids.device).unsqueeze(1) + keep.long().cumsum(-1) - 1
        flat = place[keep]  # the flat position of every valid token, in the batch's row-major order
        packed_ids = ids.new_zeros(len(bins) * width)
        packed_ids[flat] = ids[keep]
        # a row's tail (padding) gets positions 0, 1, ... : a sequence of its own that nothing reads
        columns = torch.arange(width, device=pos.device, dtype=pos.dtype)
        packed_pos = (
            columns - torch.tensor(totals, device=pos.device, dtype=pos.dtype).unsqueeze(1)
        ).flatten()
        packed_pos[flat] = pos[keep]
        rows = place[:, -resp_len:][valid] - 1  # a token's logit sits one position left
        shape = (len(bins), width)
        kwargs = {"input_ids": packed_ids.view(shape), "position_ids": packed_pos.view(shape)}
        if VISION_KEY in micro:
            packed = torch.zeros(len(bins) * width, dtype=torch.bool, device=ids.device)
            packed[flat] = True
            order = [i for members in bins for i in members]  # the images' order in the rows
            kwargs.update(
                self._vision_kwargs(micro, order, packed_pos.view(shape), packed.view(shape), flat)
            )
        return kwargs, rows

    def _vision_kwargs(self, micro: dict, order: list[int], text_pos: torch.Tensor, keep: torch.Tensor,
                       flat: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
        """Qwen2.5-VL's inputs of a micro-batch with images: `pixel_values` and `image_grid_thw` of
        its rows in `order` (the order their image pads meet in the model's (R, W) input), and
        `position_ids` (4, R, W): row 0 the text positions `text_pos` (from which transformers
        builds the block-causal or padded mask), rows 1-3 each sequence's multimodal rotary
        positions (temporal, height, width) from the model's own `get_rope_index` over its valid
        tokens, placed where `keep` is True (padded) or at the flat places `flat` (packed, in the
        micro-batch's row-major order); elsewhere the text positions."""
        items = micro[VISION_KEY]
        ids, attn = micro["input_ids"], micro["attention_mask"].bool()
        model = hf_model(self.actor_module)  # through LoRA's wrappers
        rope_index, image_token = model.model.get_rope_index, model.config.image_token_id
        sections = []
        for i in range(len(ids)):
            tokens = ids[i][attn[i]][None]
            grid = items[i].get("image_grid_thw")
            positions, _ = rope_index(tokens, mm_token_type_ids=(tokens == image_token).long(),
                                      image_grid_thw=grid if grid is not None and len(grid) else None)  # fmt: skip
            sections.append(positions[:, 0])  # (3, valid tokens of row i)
        mrope = text_pos.unsqueeze(0).repeat(3, *[1] * text_pos.dim())
        if flat is None:
            mrope[:, keep] = torch.cat(sections, dim=1).to(mrope.dtype)
        else:
            mrope.view(3, -1)[:, flat] = torch.cat(sections, dim=1).to(mrope.dtype)
        images = [items[i] for i in order if len(items[i].get("image_grid_thw", ()))]
        out = {"position_ids": torch.cat([text_pos.unsqueeze(0), mrope])}
        if images:
            out["pixel_values"] = torch.cat([x["pixel_values"] for x in images]).to(ids.device)
            out["image_grid_thw"] = torch.cat([x["image_grid_thw"] for x in images]).to(ids.device)
        return out

    def _response_logits(self, micro: dict[str, torch.Tensor]) -> torch.Tensor:
        """(M, V) logits predicting the M valid response tokens; nothing else leaves the model."""
        kwargs, pick = self._model_inputs(micro)
        if pick.dtype == torch.bool:
            resp_len = micro["responses"].shape[1]
            out = self.actor_module(**kwargs, use_cache=False, logits_to_keep=resp_len + 1)
            return out.logits[pick[:, -resp_len - 1 :]]
        if kwargs["input_ids"].shape[0] == 1:  # one packed row: ask the head for exactly those
            return self.actor_module(**kwargs, use_cache=False, logits_to_keep=pick).logits[0]
        with head_rows(self.actor_module, pick):  # several rows: the head sees only the picks
            logits = self.actor_module(**kwargs, use_cache=False).logits
        if logits.shape[:2] != (1, len(pick)):
            raise RuntimeError(f"{type(self.actor_module).__name__}'s head returned logits of shape "
                               f"{tuple(logits.shape)}; expected (1, {len(pick)}, V)")  # fmt: skip
        return logits[0]

    def _without_banned(self, logits: torch.Tensor) -> torch.Tensor:
        """(M, V) logits with `banned` ids at -inf (unchanged for a text model)."""
        if self.banned is None:
            return logits
        return logits.index_fill(-1, self.banned.to(logits.device), float("-inf"))

    def _chunked_head_stats(
        self, micro: dict[str, torch.Tensor], temperature: float, entropy: bool
    ) -> dict:
        """Σπ² checkpointing: run the decoder once, then the LM head `chunk` rows at a time, so the
        (M, V) response logits are never held at once (memory O(chunk·V) instead of O(M·V))."""
        chunk = self.config.sum_pi_squared_chunk_size
        labels = micro["responses"][micro["response_mask"].bool()]
        kwargs, pick = self._model_inputs(micro)
        with root_unsharded(self.actor_module):
            # with images the whole multimodal model (vision tower, then the decoder)
            body = (
                hf_model(self.actor_module).model
                if "pixel_values" in kwargs
                else self.actor_module.get_decoder()
            )
            hidden = body(**kwargs, use_cache=False).last_hidden_state
            hidden = hidden.flatten(0, 1)[pick] if pick.dtype != torch.bool else hidden[pick]
            head = self.actor_module.get_output_embeddings()
            parts: dict[str, list[torch.Tensor]] = defaultdict(list)
            for start in range(0, hidden.shape[0], chunk):
                logits = self._without_banned(head(hidden[start : start + chunk]))
                for key, value in token_stats(
                    logits, labels[start : start + chunk], temperature, entropy, True, chunk
                ).items():
                    parts[key].append(value)
        return {k: torch.cat(v) for k, v in parts.items()}

    def _forward_micro_batch(
        self,
        micro: dict[str, torch.Tensor],
        temperature: float,
        entropy: bool,
        sum_pi_squared: bool,
    ) -> dict[str, torch.Tensor]:
        valid = micro["response_mask"].bool()
        if (
            sum_pi_squared
            and self.config.sum_pi_squared_checkpointing
            and not torch.is_grad_enabled()
        ):
            stats = self._chunked_head_stats(micro, temperature, entropy)
        else:
            logits = self._without_banned(self._response_logits(micro))
            chunk = self.config.sum_pi_squared_chunk_size
            topk = micro["guidance_topk_ids"][valid] if "guidance_topk_ids" in micro else None
            stats = token_stats(logits, micro["responses"][valid], temperature, entropy,
                                sum_pi_squared, chunk, topk)  # fmt: skip
        out = {}
        for key, values in stats.items():  # (M, ...) rows back to (B, T, ...)
            full = values.new_zeros((*valid.shape, *values.shape[1:]))
            full[valid] = values
            out[key] = full
        return out

    def _micro_batches(
        self, data: DataProto, size: int
    ) -> tuple[list[DataProto], torch.Tensor | None]:
        """Fixed-size micro-batches, or token-balanced ones (with the row order to undo)."""
        if not self.config.dynamic_batching:
            return data.split(size), None
        order = balanced_partition(
            data.batch["attention_mask"].sum(-1).tolist(), self.config.max_token_len_per_device
        )
        flat = [i for part in order for i in part]
        return data.index_select(flat).split([len(p) for p in order]), torch.argsort(
            torch.tensor(flat)
        )

    @torch.no_grad()
    def compute_log_prob(self, data: DataProto, calculate_entropy: bool = False) -> DataProto:
        """`old_log_probs` (B, T) of the responses under logits / temperature (+ entropy, Σπ²)."""
        temperature = data.meta_info.get("temperature", 1.0)
        self.actor_module.eval()
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        size = self.config.micro_batch_size_per_device_for_experience
        micros, undo = self._micro_batches(_select(data, MODEL_INPUTS), size)
        for micro in micros:
            batch = _as_dict(micro)
            out = self._forward_micro_batch(
                batch, temperature, calculate_entropy, self.config.calculate_sum_pi_squared
            )
            for key, value in out.items():
                parts[key].append(value)
        tensors = {
            ("old_log_probs" if k == "log_probs" else k): torch.cat(v) for k, v in parts.items()
        }
        if undo is not None:
            tensors = {k: v[undo.to(v.device)] for k, v in tensors.items()}
        return DataProto.from_dict(tensors, meta_info={"temperature": temperature})

    # ------------------------------------------------------------------ update
    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        """Mini-batches x micro-batches x ppo_epochs of the configured policy loss (+ KL, entropy).

        Micro-batch losses are normalised by the whole mini-batch's token / sequence counts across
        all ranks, so accumulating their gradients equals one full mini-batch step.
        """
        if self.actor_optimizer is None:
            raise RuntimeError("update_policy needs an optimizer")
        temperature = data.meta_info.get("temperature", 1.0)
        wanted = (*MODEL_INPUTS, "old_log_probs", "advantages", *OPTIONAL_UPDATE_KEYS)
        if self.config.distill_coef > 0:
            wanted += DISTILL_KEYS + (TOPK_KEYS if self.config.distill_topk_forward else ())
        if MISMATCH_MASK_KEY in data.batch.keys():
            wanted += (MISMATCH_MASK_KEY, "rollout_log_probs")
        data = _select(data, [k for k in wanted if k in data.batch.keys()])
        _, world = _world()
        mini_size = max(self.config.global_batch_size // world, 1)
        metrics: dict[str, list[float]] = defaultdict(list)
        self.actor_module.train()
        for epoch in range(self.config.ppo_epochs):
            for i, mini in enumerate(data.split(mini_size)):
                first = epoch == 0 and i == 0  # before any optimizer step: π_θ is π_old
                forced = data.meta_info.get("mismatch_forced_threshold") if first else None
                self._update_mini_batch(mini, temperature, world, metrics, forced)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return dict(metrics)

    def _update_mini_batch(
        self,
        mini: DataProto,
        temperature: float,
        world: int,
        metrics: dict,
        mismatch_forced: float | None = None,
    ) -> None:
        """One optimizer step over `mini`'s micro-batches. With `mismatch_forced` (the first
        mini-batch, before any step) and a `MISMATCH_MASK_KEY` in the batch, the forward's
        log-probs are π_old itself: mismatch/* compare them with the engine's."""
        device = mini.batch["response_mask"].device
        mask = mini.batch["response_mask"]
        num_tokens = _all_reduce_sum(mask.sum().item(), device)
        num_seqs = _all_reduce_sum((mask.sum(-1) > 0).sum().item(), device)
        want_entropy = self.config.entropy_coeff != 0
        totals: dict[str, float] = defaultdict(
            float
        )  # mini-batch values: sums of normalised micro parts
        self.actor_optimizer.zero_grad(set_to_none=True)
        seen: list[tuple] = []  # (engine, actor log-probs, mask, offpolicy) for mismatch/*
        for micro in self._micro_batches(mini, self.config.micro_batch_size_per_device_for_update)[
            0
        ]:
            batch = _as_dict(micro)
            stats = self._forward_micro_batch(batch, temperature, want_entropy, False)
            if mismatch_forced is not None and MISMATCH_MASK_KEY in batch:
                seen.append((batch["rollout_log_probs"], stats["log_probs"].detach(),
                             batch[MISMATCH_MASK_KEY], batch.get("offpolicy_mask")))  # fmt: skip
            loss, pg_metrics = self.policy_loss_fn(
                batch["old_log_probs"], stats["log_probs"], batch["advantages"], batch["response_mask"],
                config=self.loss_config,
                behavior_log_probs=batch.get("behavior_log_probs"),
                importance_weights=batch.get("importance_weights"),
                offpolicy_mask=batch.get("offpolicy_mask"),
                rollout_mask=batch.get("rollout_mask"),
                global_num_tokens=num_tokens, global_num_seqs=num_seqs,
            )  # fmt: skip
            agg = dict(loss_agg_mode=self.loss_config.loss_agg_mode, horizon=self.loss_config.loss_horizon,
                       global_num_tokens=num_tokens, global_num_seqs=num_seqs)  # fmt: skip
            if want_entropy:
                entropy = agg_loss(stats["entropy"], batch["response_mask"], **agg)
                loss = loss - self.config.entropy_coeff * entropy
                totals[M.ACTOR_ENTROPY] += entropy.item()
            if self.config.use_kl_loss and "ref_log_probs" in batch:
                kl = kl_penalty(stats["log_probs"], batch["ref_log_probs"], self.config.kl_penalty)
                kl_loss = agg_loss(kl, batch["response_mask"], **agg)
                loss = loss + self.config.kl_coef * kl_loss
                totals[M.ACTOR_KL_LOSS] += kl_loss.item()
            if self.config.distill_coef > 0:
                term = self._distill_term(batch, stats, agg)
                loss = loss + self.config.distill_coef * term
                totals[M.ACTOR_DISTILL_LOSS] += term.item()
            # FSDP averages gradients over ranks; the global normalisers already divide by all ranks
            (loss * world).backward()
            for key, value in pg_metrics.items():
                if key == M.ACTOR_PG_LOSS:
                    totals[key] += value
                else:
                    metrics[key].append(value)
        for (
            key,
            value,
        ) in totals.items():  # this rank's share; summed over ranks it is the full value
            metrics[key].append(_all_reduce_sum(value, device))
        if seen:
            for key, value in _mismatch(seen, mismatch_forced).items():
                metrics[key].append(value)
        grad_norm = self._clip_and_step()
        metrics[M.ACTOR_GRAD_NORM].append(grad_norm)
        metrics[M.ACTOR_SKIPPED_STEPS].append(float(not math.isfinite(grad_norm)))
        metrics[M.ACTOR_LR].append(self.actor_optimizer.param_groups[0]["lr"])

    def _distill_term(self, batch: dict, stats: dict, agg: dict) -> torch.Tensor:
        """The distillation loss term (unscaled): the sampled reverse KL toward the guidance, or
        the forward KL over its top-K rows (`distill_topk_forward`)."""
        missing = batch.get("guidance_missing_mask")
        if self.config.distill_topk_forward:
            return distill_topk_forward_loss(stats["topk_log_probs"], batch["guidance_topk_log_probs"],
                                             batch["response_mask"], missing, **agg)  # fmt: skip
        return distill_loss(stats["log_probs"], batch["guidance_log_probs"], batch["response_mask"], missing,
                            batch.get("importance_weights"), self.config.distill_estimator, **agg)  # fmt: skip

    def _clip_and_step(self) -> float:
        params = [p for p in self.actor_module.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if not math.isfinite(grad_norm):
            self.actor_optimizer.zero_grad(set_to_none=True)
            return grad_norm
        self.actor_optimizer.step()
        return grad_norm
