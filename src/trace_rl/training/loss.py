"""The clipped policy-gradient loss over policy tokens, with optional KL to a reference policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor
    """Scalar to backpropagate: Σ_t w_t · ℓ_t / denominator (token-mean over the whole mini-batch)."""
    pg_loss: float
    kl: float
    clipfrac: float
    """Share of weighted tokens whose ratio was clipped."""
    ratio_mean: float


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    denominator: float,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossOutput:
    """PPO-clip per token, aggregated as a token mean (DAPO's token-level sum over the mini-batch).

    ratio = exp(logπ − logπ_old); ℓ_t = max(−A·ratio, −A·clip(ratio, 1−clip_low, 1+clip_high)),
    with DAPO's asymmetric "clip-higher" defaults. `weights` count each token (0 = not trained).
    `denominator` is the mini-batch's total weight, so micro-batches add up to one token mean.
    The KL term uses the k3 estimator exp(ref − logπ) − (ref − logπ) − 1 (as in GRPO / verl).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    scale = max(denominator, 1e-8)
    pg = (per_token * weights).sum() / scale
    loss = pg
    kl_value = 0.0
    if ref_logprobs is not None and kl_coef > 0.0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        kl_term = (kl * weights).sum() / scale
        loss = loss + kl_coef * kl_term
        kl_value = float(kl_term.detach())
    with torch.no_grad():
        trained = weights > 0
        was_clipped = (clipped > unclipped) & trained
        clipfrac = float((was_clipped.float() * weights).sum() / scale)
        ratio_mean = float((ratio * weights).sum() / scale)
    return LossOutput(loss=loss, pg_loss=float(pg.detach()), kl=kl_value, clipfrac=clipfrac, ratio_mean=ratio_mean)
