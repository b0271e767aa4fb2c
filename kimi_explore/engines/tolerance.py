"""When does another engine's value at a site count as diverging? The tolerance model.

For a site s and token t, with kimi_explore's value r_t (the trusted side: exact against Moonshot's
reference) and the other engine's o_t:

    max_abs_t = max |o_t - r_t|
    scale_t   = max( max|r_t| , floor * max_{t' <= t} max|r_t'| )   the site's magnitude, floored
    rel_t     = max_abs_t / scale_t
    beyond tolerance  <=>  rel_t > rtol

The relative error is taken against the largest entry of the token's value (not element-wise: a
near-zero entry of a float32 vector carries float32 rounding of the large ones), and a token whose
value is small compared with the same site at earlier tokens is judged against `floor` times the
site's largest magnitude up to that token (a gate near zero). Only earlier tokens: the verdict at
token t does not depend on how many tokens follow in the dump, and token 0 (a state that has barely
started, `kda.o` read from it) is judged against its own magnitude; a floor over all tokens let a
0.4% error of `layers.3.kda.o` at token 0 (set d, twice rtol) pass and be reported one site later.

`rtol` follows the other engine's activation dtype: float32 sums in another order agree to ~1e-5
relative per operation and drift to a few 1e-4 over a deep model; bf16 / fp16 activations round
every value to 8 / 11 bits; quantised activations (e.g. ggml's Q8_0 blocks before an MXFP4 matmul)
to about 7.

    preset      rtol    floor
    float32     2e-3    0.1
    float16     1e-2    0.1
    bfloat16    3e-2    0.1
    quantised   1e-1    0.1

Integer sites (`moe.router.topk_ids`) are compared as sets: max_abs_t = the number of ids in one
top-k set and not in the other, rel_t = max_abs_t / k (reported, never compared with rtol), beyond
tolerance as soon as one id differs, whatever the preset: another expert is another computation, and
1/16 of K3's top-16 would pass the quantised rtol of 0.1. `beyond` is the one verdict everything uses.
`moe.router.topk_weights` are compared in the order of their expert ids (engines may list the same
set in another order); where the other engine gives no ids, both sides largest first.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

__all__ = ["IDS_SITE", "TOLERANCE_PRESETS", "Tolerance", "beyond", "site_errors"]

IDS_SITE = "moe.router.topk_ids"  # the integer site kind: compared as sets


@dataclass(frozen=True)
class Tolerance:
    """rtol: the largest relative error (see the module docstring) still agreeing; floor: the fraction of
    the site's largest magnitude below which a token's own magnitude is not used as the scale."""

    rtol: float
    floor: float = 0.1
    name: str = "custom"

    @classmethod
    def of(cls, spec) -> Tolerance:
        """A `Tolerance`, a preset name ("float32", "bfloat16", "float16", "quantised") or a float rtol."""
        if isinstance(spec, Tolerance):
            return spec
        if isinstance(spec, str):
            if spec not in TOLERANCE_PRESETS:
                raise ValueError(f"tolerance={spec!r}: expected one of {sorted(TOLERANCE_PRESETS)}, a float rtol or a Tolerance")
            return TOLERANCE_PRESETS[spec]
        if isinstance(spec, numbers.Real) and not isinstance(spec, (bool, np.bool_)) and spec > 0:
            return cls(float(spec))  # a NumPy scalar (np.float32(3e-2), from a dtype's eps) too
        raise TypeError(f"tolerance={spec!r}: expected a preset name, a positive float rtol or a Tolerance")


TOLERANCE_PRESETS = {
    "float32": Tolerance(2e-3, 0.1, "float32"),
    "float16": Tolerance(1e-2, 0.1, "float16"),
    "bfloat16": Tolerance(3e-2, 0.1, "bfloat16"),
    "quantised": Tolerance(1e-1, 0.1, "quantised"),
}


def site_errors(kind: str, ours: list, theirs: list, tol: Tolerance) -> tuple[np.ndarray, np.ndarray]:
    """Per token (max_abs [T], rel [T]) of `theirs` against `ours` at one site (`kind` = the name
    without its layer prefix). Each list holds one array per token, ours and theirs of one shape."""
    T = len(ours)
    max_abs, rel = np.zeros(T), np.zeros(T)
    if kind.endswith(IDS_SITE):
        for t in range(T):
            a, b = set(np.asarray(ours[t]).tolist()), set(np.asarray(theirs[t]).tolist())
            max_abs[t] = len(a ^ b) / 2
            rel[t] = max_abs[t] / max(len(a), 1)
        return max_abs, rel
    mags = np.array([float(np.max(np.abs(r))) if np.size(r) else 0.0 for r in ours])
    site_mag = np.maximum.accumulate(mags) if T else mags  # the site's largest magnitude up to each token
    for t in range(T):
        r = np.asarray(ours[t], np.float64)
        o = np.asarray(theirs[t], np.float64)
        max_abs[t] = float(np.max(np.abs(o - r))) if r.size else 0.0
        scale = max(mags[t], tol.floor * site_mag[t], np.finfo(np.float32).tiny)
        rel[t] = max_abs[t] / scale
    return max_abs, rel


def beyond(kind: str, rel, rtol: float) -> np.ndarray:
    """Where the relative errors `rel` (from `site_errors` for site kind `kind`) are beyond tolerance: a NaN
    always; top-k ids as soon as one id differs (their rel, the fraction of ids that differ, is not an rtol's)."""
    rel = np.asarray(rel)
    if kind.endswith(IDS_SITE):
        return ~(rel == 0)
    return ~(rel <= rtol)
