"""Log-probabilities and the KL divergence the analyses report, in float64 on the host."""

from __future__ import annotations

import numpy as np

__all__ = ["kl_divergence", "log_softmax"]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis (host arrays)."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl_divergence(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """KL(p || q) over the last axis from log-probabilities: sum p (log p - log q), a token p gives no mass adding
    nothing (a logit of -inf, a banned token, made the terms 0 * (-inf - -inf) = NaN); +inf where q gives none to a
    token p gives some."""
    p = np.exp(log_p)
    with np.errstate(invalid="ignore"):  # (-inf) - (-inf) where p = 0: not taken
        terms = np.where(p > 0, p * (log_p - log_q), 0.0)
    return terms.sum(axis=-1)
