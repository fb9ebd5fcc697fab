"""Rollout: the draft vLLM engine and optional guidance engine. Config is importable without vLLM."""

from verl.workers.rollout.config import OffPolicyGuidanceConfig, RolloutConfig

__all__ = ["OffPolicyGuidanceConfig", "RolloutConfig"]
