"""vLLM rollout: the draft engine, and with guidance a second engine driving speculative mixing.

EasyR1's entry point: build the engines, generate, pack. The pieces live beside it:
- `engine_config.py` / `engine_lifecycle.py`: the engines' arguments, and their build,
  sleep / wake, weight sync and awake check (`EngineLifecycle`, which `VLLMRollout` extends);
- `modes.py`: the generation modes as a registry of strategies (draft-only, speculative, mix,
  teacher-only prefill scoring); `speculative_mode.py` runs speculative rounds on the engines;
  `multi_turn_mode.py` the tool-using forms. Each mode receives the call's
  `context.RolloutContext` (the engines, the call's sampling settings and parameters, its
  counters), which `generate_sequences` builds; no mode imports this module;
- `packing.py`: the batch in EasyR1's layout and the call's counters;
- `vllm_engine.py` / `vllm_sessions.py`: the only door to vLLM's internals and the session patch.

Both engines report processed log-probs (`logprobs_mode=processed_logprobs`); the guidance scores
the proposals with `prompt_logprobs`, which the session patch processes inside the engine with
the guidance's sampling settings exactly as vLLM's sampler does (`detokenize=False` throughout:
we work on token ids). Where a rejected position needs the draft's p at guidance tokens its own
top-K does not list, the draft engine looks them up (`SessionEngine.lookup`). In speculative mode
every sequence has a rewindable session on each engine (`vllm_sessions.py`): a round computes
only the new tokens, not the whole prefix. The guidance engine runs in its own process
(`guidance_server.py`) and scores one group of sequences while the draft steps the others'
proposals (`speculative.overlapped_generate`).
"""

from __future__ import annotations

import numpy as np

from verl.protocol import DataProto
from verl.utils.vision import ImagePrompt
from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.context import RolloutContext, WaveCounter
from verl.workers.rollout.engine_lifecycle import EngineLifecycle
from verl.workers.rollout.modes import GENERATION_MODES, Job, pick_mode
from verl.workers.rollout.multi_turn import MultiTurnRuntime
from verl.workers.rollout.multi_turn_mode import MULTI_TURN_MODES, multi_turn_dataproto
from verl.workers.rollout.packing import to_dataproto, unpad_prompts


class VLLMRollout(EngineLifecycle):
    """Draft engine (+ a connection to the guidance engine) producing EasyR1-layout batches.

    `own_guidance`: start the guidance engine as a child process here (used on its own); else
    the guidance is a service reached after `connect_guidance` (the trainer's `RolloutGroup`).
    The engines' lifecycle (sleep, wake_up, sync_weights, shutdown) is `EngineLifecycle`'s."""

    def __init__(
        self,
        model_path: str,
        config: RolloutConfig,
        eos_token_id: int,
        pad_token_id: int,
        own_guidance: bool = True,
    ) -> None:
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.model_path = model_path
        super().__init__(model_path, config, own_guidance)
        self.waves = WaveCounter()  # numbers the session ids of each wave, over all calls
        self._multi_turn_runtime = None

    def multi_turn_runtime(self) -> MultiTurnRuntime:
        """The tools, call format and delta rule of `config.multi_turn` (built once)."""
        if self._multi_turn_runtime is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            config = self.config.multi_turn  # deltas rendered as the prompts were (chat or plain)
            self._multi_turn_runtime = MultiTurnRuntime(config, tokenizer, config.chat_template)
        return self._multi_turn_runtime

    def call_context(self, meta: dict) -> RolloutContext:
        """What the modes receive for a call with `meta` (its meta_info): the engines, the call's
        `temperature`, `ignore_eos` and `max_tokens` (at most `response_length`), new counters,
        and with multi-turn on, the runtime."""
        cfg = self.config
        return RolloutContext(
            config=cfg,
            engines=self.engines,
            num_logprobs=self.num_logprobs,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            max_tokens=min(int(meta.get("max_tokens", cfg.response_length)), cfg.response_length),
            temperature=float(meta.get("temperature", cfg.temperature)),
            ignore_eos=bool(meta.get("ignore_eos", False)),
            draft_sessions=self.draft_sessions,
            waves=self.waves,
            cores_to=self.cores_to,
            multi_turn=self.multi_turn_runtime() if cfg.multi_turn.enable else None,
        )

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample `n` responses per prompt in the mode `modes.pick_mode` picks (draft-only,
        speculative, mix or teacher-only prefill scoring). EasyR1 layout out."""
        self.wake_up()
        self._check_awake()
        meta = prompts.meta_info
        n = meta.get("n", self.config.n)
        prompt_ids = unpad_prompts(prompts.batch["input_ids"], prompts.batch["attention_mask"])
        too_long = [len(p) for p in prompt_ids if len(p) > self.config.prompt_length]
        if too_long:
            raise ValueError(
                f"{len(too_long)} prompt(s) longer than worker.rollout.prompt_length={self.config.prompt_length} "
                f"(longest {max(too_long)} tokens); filter them in the dataset (data.filter_overlong_prompts)"
            )
        repeated = [ids for ids in prompt_ids for _ in range(n)]
        step_seed = int(meta.get("seed", self.config.seed)) + 7919 * int(meta.get("global_step", 0))
        seeds = sequence_seeds(step_seed, int(meta.get("first_row", 0)), len(prompt_ids), n,
                               int(meta.get("stage", 0)))  # fmt: skip
        ctx = self.call_context(meta)
        mode, lam = pick_mode(self.config.offpolicy_guidance, meta, n)
        if self.config.multi_turn.enable:  # the mode's multi-turn form (mix: refused by the config)
            mode = MULTI_TURN_MODES[mode]
        job = Job(repeated, n, seeds, lam, meta)
        if "multi_modal_data" in prompts.non_tensor_batch:  # a batch with images
            job.images = image_job(prompts.non_tensor_batch, prompt_ids, n)
        result = GENERATION_MODES.get(mode)(ctx, job)
        if result.packed is not None:
            out = multi_turn_dataproto(self.config.offpolicy_guidance, self.config.prompt_length,
                                       self.pad_token_id, repeated, result.packed, lam, result.guided)  # fmt: skip
        else:
            guided = np.zeros(len(repeated), dtype=bool) if result.guided is None else result.guided
            out = to_dataproto(self.config, self.pad_token_id, self.num_logprobs, repeated,
                               result.seqs, lam, guided)  # fmt: skip
        out.non_tensor_batch = {
            k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()
        }
        out.meta_info.update(ctx.counters.meta(result.stats, out, lam, result.seqs))
        return out


def image_job(rows: dict, prompt_ids: list[list[int]], n: int) -> list[ImagePrompt | None]:
    """Per sequence (each prompt repeated n times) its images as the engines open them, from the
    batch's `raw_prompt_ids`, `multi_modal_data` and the prompts' expanded `prompt_ids`."""
    return [ImagePrompt(list(map(int, raw)), list(map(int, expanded)), data) if data else None
            for raw, expanded, data in zip(rows["raw_prompt_ids"], prompt_ids, rows["multi_modal_data"], strict=True)
            for _ in range(n)]  # fmt: skip


def sequence_seeds(step_seed: int, first_row: int, rows: int, n: int, stage: int = 0) -> np.ndarray:
    """(rows * n, 2) seeds of each sequence, row-major by prompt: its sampling seed for the
    engine and its speculative acceptance draws. A function of the step's seed, the prompt's
    row in the whole batch (`first_row` + r) and the call's `stage` alone, so a sequence gets the
    same seeds whichever replica, wave or group generates it; a second stage (`guide_when:
    group_fails`) draws its own, independent of the first stage's."""
    if rows == 0:
        return np.zeros((0, 2), dtype=np.int64)
    key = [] if stage == 0 else [stage]
    return np.concatenate(
        [
            np.random.default_rng([step_seed, first_row + r, *key]).integers(0, 2**31, (n, 2))
            for r in range(rows)
        ]
    )
