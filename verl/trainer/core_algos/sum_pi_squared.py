"""Σπ² per position from logits (chunked) and the forward-only gradient-variance proxies."""

from __future__ import annotations

import torch

from verl.utils import metric_names as M
from verl.utils.torch_functional import masked_mean


def softmax_statistics(
    z: torch.Tensor, entropy: bool = False, sum_pi_squared: bool = False
) -> dict[str, torch.Tensor]:
    """lse = logsumexp(z), and optionally H = lse - Σπz and Σπ² = Σe²/(Σe)², from ONE exp pass.

    With m = max z and e = exp(z - m): lse = m + log Σe, π = e/Σe, so Σπ² = Σe²/(Σe)², which is
    exactly exp(logsumexp(2z) - 2·logsumexp(z)) without a second exponential. -inf entries give
    e = 0. Shapes (M, V) -> (M,) each. Paper: https://arxiv.org/abs/2602.07078 (OTB).
    """
    if not (entropy or sum_pi_squared):
        return {"lse": torch.logsumexp(z, dim=-1)}  # fused kernel, fastest for log-probs alone
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = z - m
    e.exp_()  # the one exponential pass, in place
    total = e.sum(dim=-1)
    out = {"lse": m.squeeze(-1) + torch.log(total)}
    if entropy:
        weighted = torch.where(e > 0, e * z, torch.zeros_like(e)).sum(dim=-1)
        out["entropy"] = out["lse"] - weighted / total
    if sum_pi_squared:
        out["sum_pi_squared"] = torch.linalg.vector_norm(e, dim=-1).square() / (
            total * total
        )  # fused, no e² temporary
    return out


@torch.no_grad()
def compute_sum_pi_squared(
    logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> torch.Tensor:
    """Σ_v π_v² = exp(logsumexp(2z) - 2·logsumexp(z)), z = logits / temperature. (B, T, V) -> (B, T).

    Processed `chunk_size` rows at a time, so the extra memory is O(chunk_size·V), never a second
    (B, T, V) tensor; evaluated as Σe²/(Σe)² with e = exp(z - max z) (`softmax_statistics`).
    -inf logits (masked vocabulary) contribute 0; each row needs one finite logit. Computed in
    float32 (float64 inputs stay float64). Any leading shape works.
    Paper: https://arxiv.org/abs/2602.07078 (OTB's logit-gradient proxy).
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = torch.empty(flat.shape[0], dtype=out_dtype, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        z = flat[start : start + chunk_size].to(out_dtype)
        if temperature != 1.0:
            z = z / temperature
        out[start : start + chunk_size] = softmax_statistics(z, sum_pi_squared=True)[
            "sum_pi_squared"
        ]
    return out.reshape(logits.shape[:-1])


def score_energy(
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    response_mask: torch.Tensor,
    importance_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token ‖e_y - π‖² = 1 - 2π(y) + Σπ² (× w² with importance weights), 0 on padding. (B, T)."""
    energy = 1.0 - 2.0 * old_log_probs.exp() + sum_pi_squared
    if importance_weights is not None:
        energy = energy * importance_weights.detach() ** 2
    return energy * response_mask


def compute_variance_proxy_metrics(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    importance_weights: torch.Tensor | None = None,
    grad_norm: float | None = None,
) -> dict[str, float]:
    """Gradient-variance proxies from forward quantities: ‖ĝ_i‖² ≈ A_i²·W_i, W_i = Σ_t ‖e_y - π‖².

    proxy2_total_power = mean_i A_i² W_i; proxy1_signal_strength = ‖ḡ‖² (the measured grad norm,
    when given); proxy3_pure_noise = (proxy2 - proxy1)/(N - 1). A_i is the masked mean advantage;
    only responses with valid tokens count (N of them). Inputs (B, T).
    Paper: https://arxiv.org/abs/2602.07078 (OTB, variance diagnostics).
    """
    valid_seq = response_mask.sum(dim=-1) > 0
    n = int(valid_seq.sum().item())
    if n == 0:
        return {}
    w_seq = score_energy(old_log_probs, sum_pi_squared, response_mask, importance_weights).sum(
        dim=-1
    )
    a_seq = masked_mean(advantages, response_mask, dim=-1)
    a2, w_seq = (a_seq**2)[valid_seq], w_seq[valid_seq]
    metrics = {
        M.VARIANCE_PROXY_TOTAL_POWER: (a2 * w_seq).mean().item(),
        M.VARIANCE_PROXY_EXPECTED_A2: a2.mean().item(),
        M.VARIANCE_PROXY_EXPECTED_W: w_seq.mean().item(),
    }
    if grad_norm is not None:
        signal = float(grad_norm) ** 2
        metrics[M.VARIANCE_PROXY_SIGNAL] = signal
        metrics[M.VARIANCE_PROXY_PURE_NOISE] = (
            metrics[M.VARIANCE_PROXY_TOTAL_POWER] - signal
        ) / max(n - 1, 1)
    return metrics
