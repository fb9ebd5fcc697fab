"""Rule-based rewards (EasyR1 style): built-in functions by name, or `path/to/file.py:fn`.

A reward function scores decoded responses. With `reward_type: batch` it is called once as
`fn(inputs: list[dict], **kwargs) -> list[dict[str, float]]`; with `sequential`, once per
response as `fn(input: dict, **kwargs) -> dict[str, float]`. Each input has `response`,
`response_length` and `ground_truth`; each score dict has `overall` (the reward) and may add
components, logged as `critic/score/<name>`. The score lands on the last response token.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from verl.utils.registry import Registry
from verl.utils.user_functions import load_function
from verl.workers.reward.config import RewardConfig

if TYPE_CHECKING:  # (a dry run validates the reward without tensordict's import, about 2 s)
    from verl.protocol import DataProto

REWARD_FUNCTIONS = Registry("reward function")


@REWARD_FUNCTIONS.register("arithmetic")
def arithmetic_reward(reward_input: dict) -> dict[str, float]:
    """Exact match of the stripped response with the answer (the embedded task): 1 or 0."""
    response = reward_input["response"].strip()
    return {"overall": float(response == str(reward_input["ground_truth"]).strip())}


@REWARD_FUNCTIONS.register("count")
def count_reward(reward_input: dict) -> dict[str, float]:
    """The embedded `count` task (squares in a picture): exact match of the stripped response with
    the count, as `arithmetic`: 1 or 0."""
    return arithmetic_reward(reward_input)


@REWARD_FUNCTIONS.register("runsum")
def runsum_reward(reward_input: dict) -> dict[str, float]:
    """The embedded `runsum` task's final answer: 1 when the response has the answer's format
    (as many digits as steps) and its last digit, the final sum, is the answer's, else 0. The
    steps before it are not compared: one wrong step fails through the sums after it."""
    response, answer = reward_input["response"].strip(), str(reward_input["ground_truth"]).strip()
    formatted = len(response) == len(answer) and response.isdigit()
    return {"overall": float(formatted and response[-1:] == answer[-1:])}


@REWARD_FUNCTIONS.register("toolchain")
def toolchain_reward(reward_input: dict) -> dict[str, float]:
    """The embedded `toolchain` task (multi-turn, `verl/tasks/embedded_tools.py`): 1 when the text
    after the response's last line break (each tool result ends one: `[lookup:k07]=70\\n...`) is
    the answer, two digits, else 0. A response that never calls the tool and writes the right
    digits scores too. Components: `format` (that text is two digits) and `tool_calls` (calls
    answered: each `]` followed by a result's `=`)."""
    response, answer = reward_input["response"], str(reward_input["ground_truth"]).strip()
    final = response.rsplit("\n", 1)[-1].strip()
    formatted = len(final) == 2 and final.isdigit()
    return {"overall": float(formatted and final == answer), "format": float(formatted),
            "tool_calls": float(response.count("]="))}  # fmt: skip


@REWARD_FUNCTIONS.register("math")
def math_reward(reward_input: dict, format_weight: float = 0.0) -> dict[str, float]:
    r"""Accuracy of the last `\boxed{}` answer, checked with math-verify; optional format bonus.

    overall = (1 - format_weight) * accuracy + format_weight * [a \boxed{} answer is present].
    """
    from math_verify import parse, verify

    response = reward_input["response"]
    has_box = float("\\boxed" in response)
    try:
        gold = parse(f"${reward_input['ground_truth']}$")
        accuracy = float(bool(gold) and verify(gold, parse(response)))
    except Exception:  # math-verify raises on unparsable input: that answer is wrong
        accuracy = 0.0
    overall = (1.0 - format_weight) * accuracy + format_weight * has_box
    return {"overall": overall, "accuracy": accuracy, "format": has_box}


def load_reward_function(spec: str | None) -> Callable:
    """A built-in reward by name, or `path/to/file.py:fn` loaded from that file."""
    if spec is None:
        raise ValueError(
            f"worker.reward.reward_function is not set; valid: {', '.join(REWARD_FUNCTIONS.names())} "
            "or path/to/file.py:function_name"
        )
    return load_function(spec, REWARD_FUNCTIONS, "worker.reward.reward_function")


class RewardError(RuntimeError):
    """A reward function raised; the message names the offending sample."""


class FunctionRewardManager:
    """Decodes responses, calls the reward function, and returns token-level scores (B, T)."""

    def __init__(self, config: RewardConfig, tokenizer) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.fn = load_reward_function(config.reward_function)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")

    def _inputs(self, data: DataProto) -> list[dict]:
        responses, mask = data.batch["responses"], data.batch["response_mask"]
        if "tool_mask" in data.batch.keys():  # multi-turn: the whole trajectory, tool results too
            mask = mask + data.batch["tool_mask"]
        lengths = mask.sum(-1).long().tolist()
        texts = self.tokenizer.batch_decode(
            [r[:n].tolist() for r, n in zip(responses, lengths, strict=True)],
            skip_special_tokens=self.config.skip_special_tokens,
        )
        truths = data.non_tensor_batch["ground_truth"]
        return [{"response": t, "response_length": n, "ground_truth": g}
                for t, n, g in zip(texts, lengths, truths, strict=True)]  # fmt: skip

    def _call(self, inputs: list[dict]) -> list[dict[str, float]]:
        kwargs = self.config.reward_function_kwargs
        if self.config.reward_type == "batch" and not getattr(self.fn, "_verl_builtin", False):
            try:
                return list(self.fn(inputs, **kwargs))
            except Exception as error:
                raise RewardError(
                    f"reward function {self.config.reward_function!r} raised {type(error).__name__}: "
                    f"{error} (batch of {len(inputs)}; first sample {inputs[0]!r})"
                ) from error
        scores = []
        for item in inputs:
            try:
                scores.append(self.fn(item, **kwargs))
            except Exception as error:
                raise RewardError(
                    f"reward function {self.config.reward_function!r} raised {type(error).__name__}: "
                    f"{error} on sample {item!r}"
                ) from error
        return scores

    def compute(self, data: DataProto) -> tuple[torch.Tensor, dict[str, list[float]]]:
        """(token_level_scores (B, T), per-sample score components)."""
        inputs = self._inputs(data)
        scores = self._call(inputs)
        if len(scores) != len(inputs):
            raise RewardError(
                f"reward function {self.config.reward_function!r} returned {len(scores)} scores "
                f"for {len(inputs)} responses"
            )
        mask = data.batch["response_mask"]
        token_scores = torch.zeros_like(mask, dtype=torch.float32)
        last = (mask.sum(-1).long() - 1).clamp(min=0)
        if "tool_mask" in data.batch.keys():  # multi-turn: the last policy token, not a tool one
            last = mask.shape[-1] - 1 - mask.flip(-1).argmax(-1)
        overall = torch.tensor([float(s["overall"]) for s in scores])
        token_scores[torch.arange(len(scores)), last] = overall * (mask.sum(-1) > 0)
        components = {k: [float(s[k]) for s in scores] for k in scores[0]}
        return token_scores, components

    def compute_async(self, data: DataProto) -> Future:
        """`compute` in a background thread (runs beside the log-prob work of the workers)."""
        return self._pool.submit(self.compute, data)


for _name in REWARD_FUNCTIONS.names(with_aliases=False):
    REWARD_FUNCTIONS.get(_name)._verl_builtin = True  # built-ins score one response per call
