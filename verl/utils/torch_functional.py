"""Masked reductions on (B, T) tensors. Padding (mask 0) never contributes to any result."""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask over `dim` (all elements when None)."""
    prod = values * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask / Σ mask; an empty mask gives 0 rather than NaN."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries (Bessel-corrected when `unbiased`)."""
    mean = masked_mean(values, mask)
    sq = masked_sum((values - mean) ** 2, mask)
    count = mask.sum()
    if unbiased:
        if count <= 1:
            return torch.zeros((), dtype=values.dtype, device=values.device)
        return sq / (count - 1)
    return sq / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) over the masked entries; padding is left at 0."""
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def masked_stats(values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """mean / std / min / max of the masked entries as Python floats (zeros when empty)."""
    sel = values[mask.bool()]
    if sel.numel() == 0:
        return {"mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0}
    std = sel.std().item() if sel.numel() > 1 else 0.0
    return {"mean": sel.mean().item(), "std": std, "min": sel.min().item(), "max": sel.max().item()}


def selected_mean(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Σ values over `keep` / Σ keep. Entries outside `keep` are never read, so a NaN or inf there
    cannot leak in (masked_mean's product gives NaN·0 = NaN); an empty `keep` gives 0."""
    keep = keep.bool()
    picked = torch.where(keep, values, torch.zeros_like(values))
    return masked_mean(picked, keep.to(values.dtype))
