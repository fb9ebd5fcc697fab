"""vLLM rollout: the draft engine, and with guidance a second engine driving speculative mixing.

EasyR1's entry point: build the engines, generate, pack. The pieces live beside it:
- `engine_config.py` / `engine_lifecycle.py`: the engines' arguments, and their build,
  sleep / wake, weight sync and awake check (`EngineLifecycle`, which `VLLMRollout` extends);
- `modes.py`: the generation modes as a registry of strategies (draft-only, speculative, mix,
  teacher-only prefill scoring); `speculative_mode.py` runs speculative rounds on the engines;
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
from verl.workers.rollout.config import RolloutConfig
from verl.workers.rollout.engine_lifecycle import EngineLifecycle
from verl.workers.rollout.modes import GENERATION_MODES, Job, pick_mode, whole_response
from verl.workers.rollout.multi_turn_mode import MULTI_TURN_MODES, multi_turn_dataproto
from verl.workers.rollout.packing import Counters, to_dataproto, unpad_prompts
from verl.workers.rollout.speculative import GuidedSequence
from verl.workers.rollout.vllm_sessions import sampled_log_probs


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
        self._call = 0  # numbers the session ids of each wave
        self._multi_turn_runtime = None

    def multi_turn_runtime(self):
        """The tools, call format and delta rule of `config.multi_turn` (built once)."""
        if self._multi_turn_runtime is None:
            from transformers import AutoTokenizer

            from verl.workers.rollout.multi_turn import MultiTurnRuntime

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            config = self.config.multi_turn  # deltas rendered as the prompts were (chat or plain)
            self._multi_turn_runtime = MultiTurnRuntime(config, tokenizer, config.chat_template)
        return self._multi_turn_runtime

    # ------------------------------------------------------------------ sampling settings
    def _draft_params(self, max_tokens: int, logprobs: int, seed: int, **overrides):
        from vllm import SamplingParams

        return SamplingParams(**self._sampling_kwargs(max_tokens, logprobs, seed, **overrides))

    def _sampling_kwargs(self, max_tokens: int, logprobs: int, seed: int, **overrides) -> dict:
        """SamplingParams fields of a rollout request (the guidance process builds its own)."""
        cfg = self.config
        kwargs = dict(temperature=self._temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=max_tokens,
                      logprobs=logprobs, seed=seed, detokenize=False, ignore_eos=self._ignore_eos, flat_logprobs=True,
                      stop_token_ids=[] if self._ignore_eos else [self.eos_token_id], skip_clone=True)  # fmt: skip
        kwargs.update(overrides)
        return kwargs

    def _guidance_processing(self) -> dict:
        cfg, over = self.config, self.config.offpolicy_guidance.sampling_overrides
        base = {"temperature": self._temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
        return {k: over.get(k, v) for k, v in base.items()}

    def _draft_only(self, prompts: list[list[int]], seeds) -> list[GuidedSequence]:
        """Whole responses from the draft engine, one seed per prompt."""
        params = [self._draft_params(self._max_tokens, 1, int(s)) for s in seeds]
        outputs = self.engines.draft.generate(
            [{"prompt_token_ids": p} for p in prompts],
            params,
            use_tqdm=not self.config.disable_tqdm,
        )
        return [whole_response(*sampled_log_probs(out.outputs[0]), False) for out in outputs]

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample `n` responses per prompt in the mode `modes.pick_mode` picks (draft-only,
        speculative, mix or teacher-only prefill scoring). EasyR1 layout out."""
        self.wake_up()
        self._check_awake()
        meta = prompts.meta_info
        n = meta.get("n", self.config.n)
        self._temperature = float(meta.get("temperature", self.config.temperature))
        self._ignore_eos = bool(meta.get("ignore_eos", False))
        self._max_tokens = min(
            int(meta.get("max_tokens", self.config.response_length)), self.config.response_length
        )
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
        self._counters = Counters()
        mode, lam = pick_mode(self.config.offpolicy_guidance, meta, n)
        if self.config.multi_turn.enable:  # the mode's multi-turn form (mix: refused by the config)
            mode = MULTI_TURN_MODES[mode]
        result = GENERATION_MODES.get(mode)(self, Job(repeated, n, seeds, lam, meta))
        if result.packed is not None:
            out = multi_turn_dataproto(self.config.offpolicy_guidance, self.config.prompt_length,
                                       self.pad_token_id, repeated, result.packed, lam, result.guided)  # fmt: skip
            return self._finish(out, prompts, n, result, lam)
        guided = np.zeros(len(repeated), dtype=bool) if result.guided is None else result.guided
        out = to_dataproto(self.config, self.pad_token_id, self.num_logprobs, repeated,
                           result.seqs, lam, guided)  # fmt: skip
        return self._finish(out, prompts, n, result, lam)

    def _finish(self, out: DataProto, prompts: DataProto, n: int, result, lam: float) -> DataProto:
        """The prompts' non-tensor fields repeated n times, and the call's counters as meta."""
        out.non_tensor_batch = {
            k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()
        }
        out.meta_info.update(self._counters.meta(result.stats, out, lam, result.seqs))
        return out


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
