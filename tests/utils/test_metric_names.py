"""The metric-name module is the single source of logged names, and the core only emits those."""

from __future__ import annotations

import torch

from verl.trainer import core_algos as C
from verl.utils import metric_names as M


def test_names_are_unique_and_namespaced():
    assert len(set(M.ALL_FIXED)) == len(M.ALL_FIXED)
    assert all(M.in_namespace(name) for name in M.ALL_FIXED)
    for required in (
        "guidance/offpolicy_token_ratio", "guidance/offpolicy_seq_ratio", "guidance/accept_rate", "guidance/lambda",
        "guidance/is_weight_mean", "guidance/is_weight_std", "guidance/is_weight_min", "guidance/is_weight_max",
        "guidance/is_clip_frac", "guidance/missing_logprob_ratio", "guidance/behavior_kl", "guidance/topk_tail_mass",
        "mismatch/kl_v1", "mismatch/kl_v2", "variance_proxy/proxy1_signal_strength",
        "variance_proxy/proxy2_total_power", "variance_proxy/proxy3_pure_noise", "actor/pg_loss", "actor/ppo_kl",
        "actor/pg_clipfrac", "actor/grad_norm", "actor/lr", "actor/entropy", "actor/kl_loss",
        "distill/reverse_kl", "distill/teacher_log_prob", "distill/missing_frac", "distill/advantage_abs",
        # the share each family of means leaves out (floor, NaN or missing inputs; issue 26)
        "guidance/behavior_kl_excluded_frac", "guidance/guided_excluded_frac",
        "guidance/is_weight_excluded_frac", "mismatch/excluded_frac", "distill/excluded_frac",
    ):  # fmt: skip
        assert required in M.ALL_FIXED, required


def test_core_algorithms_emit_only_documented_names():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=gen)
    new = old + 0.1 * torch.randn(4, 5, generator=gen)
    adv = torch.randn(4, 5, generator=gen)
    mask = torch.ones(4, 5)
    off = (torch.rand(4, 5, generator=gen) > 0.5).float()
    emitted = {}
    cfg = C.PolicyLossConfig(luffy_shaping=True, opsm_delta=0.1)
    for name in C.POLICY_LOSSES:
        emitted.update(
            C.get_policy_loss_fn(name)(
                old, new, adv, mask, config=cfg, behavior_log_probs=old, offpolicy_mask=off
            )[1]
        )
    emitted.update(C.compute_importance_weights(old, new, mask)[1])
    emitted.update(C.compute_mismatch_metrics(old, new, mask, off))
    emitted.update(C.compute_guidance_metrics(off, mask, new, old, off, lam=0.5))
    emitted.update(
        C.compute_variance_proxy_metrics(
            adv, mask, old, torch.rand(4, 5, generator=gen), grad_norm=1.0
        )
    )
    emitted.update(C.compute_distill_metrics(old, new, mask, off, None, "k1", adv))
    emitted.update(
        C.compute_guidance_diagnostics(
            off, mask, old, new, adv, adv.sum(-1), [0, 0, 1, 1], (0.0, 2.0), None, old.exp()
        )
    )
    assert emitted
    undocumented = [k for k in emitted if k not in M.ALL_FIXED]
    assert not undocumented, undocumented


def test_every_metric_name_written_in_the_package_is_in_the_reference():
    """Any string literal of the package that names a metric of a documented namespace (a metric
    some code logs) is a constant of metric_names and has a reference entry: nothing the trainer
    can log is missing from README_guidance's reference or the dashboard."""
    import ast
    import re
    from pathlib import Path

    from verl.utils.metric_reference import METRIC_DOCS

    root = Path(M.__file__).resolve().parents[1]
    spaces = "|".join(re.escape(ns) for ns in M.NAMESPACES)
    name = re.compile(rf"^({spaces})/[\w/<>]*[\w>]$")
    unknown = []
    for path in root.rglob("*.py"):
        if path.name in ("metric_names.py", "metric_reference.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and name.match(text) and not M.is_known(text):
                unknown.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
    assert not unknown, "metric names missing from verl/utils/metric_names.py:\n" + "\n".join(
        unknown
    )
    assert set(M.ALL_FIXED) <= set(METRIC_DOCS), sorted(set(M.ALL_FIXED) - set(METRIC_DOCS))
