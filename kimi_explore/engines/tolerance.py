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

    preset      rtol    floor   local_rtol
    float32     2e-3    0.1     1e-4
    float16     1e-2    0.1     2.5e-3
    bfloat16    3e-2    0.1     3e-2
    quantised   1e-1    0.1     5e-2

A site kind may be judged by a tolerance of its own (`Tolerance.kinds`; `compare(tolerance={"kda.decay": 0.1})`,
every layer's `kda.decay` at rtol 0.1 and the rest at the dump's dtype), for an engine known to compute one
operation differently from the rest (a fused kernel with its own rounding, a fast approximate exp). A float
given for a kind keeps the default's local_rtol / rtol ratio (float16's: rtol / 4), so loosening a kind never
tightens its local test. Top-k ids take none: they differ at one id, whatever the rtol.

`local_rtol` judges one operation alone: kimi_explore's operation on the other engine's inputs (the
teacher-forced replay, `Comparison.suspects`) against the other engine's output. One operation rounds
far less than a deep model drifts: on llama.cpp's own K3 with float32 experts (set d) the largest such
error is 1.4e-5, where whole-model drift reaches 7.1e-4. A bug too small to cross rtol where it happens
(a 1e-3 gate) crosses it layers later, where it is inherited; `local_rtol` still names it. Below
float32 an operation rounds its steps as coarsely as the drift: bfloat16's is rtol itself (mlx-lm 0.32's
`kimi_k3` in its native bf16, the trained tiny model, 48 tokens decoded: its operations on their own inputs are
up to 2.7e-2 off, the routed experts; 1.5e-2 the MLA probabilities, 1.0e-2 the short conv; a quarter of rtol
named 27 such suspects in a correct engine); quantised's rtol / 2 (ggml's Q8_0 activations put llama.cpp's MXFP4
experts 1.7e-2 to 3.7e-2 off on their own inputs, which is that engine's arithmetic, not a bug); float16's rtol / 4,
measured on no such engine here. A float rtol takes rtol / 20.

Integer sites (`moe.router.topk_ids`) are compared as sets: max_abs_t = the number of ids in one
top-k set and not in the other, rel_t = max_abs_t / k (reported, never compared with rtol), beyond
tolerance as soon as one id differs, whatever the preset: another expert is another computation, and
1/16 of K3's top-16 would pass the quantised rtol of 0.1. `beyond` is the one verdict everything uses.
`moe.router.topk_weights` are compared in the order of their expert ids (engines may list the same
set in another order); where the other engine gives no ids, both sides largest first.

Per-head sites (`HEAD_AXES`: `kda.conv_out`, `kda.v`, `kda.state`, `kda.o`, `mla.probs`) are judged head
by head, because what comes next rescales each head by itself: the KDA output norm o_h / rms(o_h) after
`kda.o` (and after `kda.state`, read out as o_h = S_h^T q_h, |o_h| <= max|S_h| since |q_h| = K^-1/2; and
after `kda.v`, which moves S_h by at most its own error), the q/k L2 norm x_h / |x_h| after
`kda.conv_out`, and each MLA head's softmax row. A 2% error on a head whose values are 2.5% of the
largest head's is 5e-4 of the site's scale, within rtol, yet that norm scales it back up to 2% one site
later, where it looked inherited. So for head h (the leading `HEAD_AXES[kind]` axes; its values r_th):

    scale_th = max( max|r_th| , floor * max_{t' <= t} max|r_t'h| , min(head_floor, scale_t) )
    rel_t    = max_h max|o_th - r_th| / scale_th                   (>= the whole-site rel_t above)

`head_floor` (`head_floors(config)`) is where the downstream norm stops rescaling: x / sqrt(mean(x^2) + eps)
amplifies a head by at most 1/sqrt(eps), so a head whose values are below sqrt(eps) leaves the norm small next
to the others (for the L2 norm x / sqrt(sum(x^2) + eps), whose sum reaches eps with entries of sqrt(eps / K):
the floor is that), and its error matters against the floor, not against
its own magnitude. Without it float32 rounding made false divergences: llama.cpp on set `d` is 4e-7 off
on a `layers.11.kda.o` head of magnitude 4e-6 at token 0 (rel 0.1; 1e-4 against sqrt(1e-5)). The
`min(.., scale_t)` keeps every per-head verdict at least as strict as the whole site's.

NaN (or an infinity) in the same entry on both sides agrees there: an engine's NaN carried downstream in
a teacher-forced replay meets the same NaN in kimi_explore's operation. A NaN on one side only differs
(rel_t is NaN, beyond any tolerance). Magnitudes are taken over finite entries.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from ..model.kda import L2NORM_EPS

__all__ = ["HEAD_AXES", "IDS_SITE", "TOLERANCE_PRESETS", "Tolerance", "beyond", "SiteErrors", "head_floors", "site_errors"]

IDS_SITE = "moe.router.topk_ids"  # the integer site kind: compared as sets
# per-head sites: kind -> how many leading axes of the per-token value index one head
HEAD_AXES = {"kda.conv_out": 2, "kda.v": 1, "kda.state": 1, "kda.o": 1, "mla.probs": 1}  # [3, H, K]: q, k, v heads


@dataclass(frozen=True)
class Tolerance:
    """rtol: the largest relative error (see the module docstring) still agreeing; floor: the fraction of
    the site's largest magnitude below which a token's own magnitude is not used as the scale."""

    rtol: float
    floor: float = 0.1
    name: str = "custom"
    local_rtol: float | None = None  # one operation's (module docstring); None: rtol / 20
    kinds: tuple = ()  # ((site kind, Tolerance), ...): the kinds judged by a tolerance of their own (`for_kind`)

    def __post_init__(self):
        if self.local_rtol is None:
            object.__setattr__(self, "local_rtol", self.rtol / 20)
        for pair in self.kinds:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], Tolerance) and not pair[1].kinds):
                raise TypeError(f"Tolerance.kinds: expected ((site kind, Tolerance without kinds), ...), got {pair!r:.60} "
                                "(Tolerance.of({kind: rtol or preset, ...}) builds them)")

    def for_kind(self, kind: str) -> Tolerance:
        """The tolerance judging sites of `kind` (e.g. "kda.decay", every layer's): its own where `kinds` names it."""
        return dict(self.kinds).get(kind, self)

    def __str__(self) -> str:
        own = "".join(f", {k} {t.name} rtol={t.rtol:g}" for k, t in self.kinds)
        return f"{self.name} rtol={self.rtol:g}{own}"

    @classmethod
    def of(cls, spec, default="float32") -> Tolerance:
        """A `Tolerance`, a preset name ("float32", "bfloat16", "float16", "quantised"), a float rtol, or a mapping
        {site kind: any of those} with the optional key "default" for every other kind (else `default`): e.g.
        {"kda.decay": 0.1} judges every layer's `kda.decay` at rtol 0.1, the rest at the default (module docstring)."""
        if isinstance(spec, Mapping):
            spec = dict(spec)
            base = spec.pop("default", default)
            if isinstance(base, Mapping):
                raise TypeError("tolerance['default']: expected a preset name, a positive float rtol or a Tolerance, "
                                "not a mapping (give the kinds beside it)")
            base = cls.of(base)
            own = {}
            for kind, value in spec.items():
                if not isinstance(kind, str):
                    raise TypeError(f"tolerance: a key must be a site kind (a str, e.g. 'kda.decay'), got {kind!r}")
                if kind.endswith(IDS_SITE):
                    raise ValueError(f"tolerance[{kind!r}]: top-k ids are compared as sets and differ at one id, "
                                     "whatever the rtol: no tolerance applies to them")
                if not isinstance(value, (str, numbers.Real, Tolerance)) or isinstance(value, (bool, np.bool_)) \
                        or (isinstance(value, Tolerance) and value.kinds):
                    raise TypeError(f"tolerance[{kind!r}]: expected a preset name, a positive float rtol or a Tolerance "
                                    f"without kinds of its own, got {value!r:.60}")
                try:
                    one = cls.of(value)
                except (TypeError, ValueError) as e:
                    raise type(e)(f"tolerance[{kind!r}]: {e}") from None
                if isinstance(value, numbers.Real):  # the default's local/rtol ratio, not a bare float's 1/20
                    one = cls(one.rtol, base.floor, local_rtol=one.rtol * base.local_rtol / base.rtol)
                own[kind] = one
            return replace(base, kinds=tuple({**dict(base.kinds), **own}.items()))
        if isinstance(spec, Tolerance):
            return spec
        if isinstance(spec, str):
            if spec not in TOLERANCE_PRESETS:
                raise ValueError(f"tolerance={spec!r}: expected one of {sorted(TOLERANCE_PRESETS)}, a float rtol or a Tolerance")
            return TOLERANCE_PRESETS[spec]
        if isinstance(spec, numbers.Real) and not isinstance(spec, (bool, np.bool_)):
            if not spec > 0:  # (0, a negative rtol, NaN: a number, but no tolerance)
                raise ValueError(f"tolerance={spec!r}: a float rtol must be > 0")
            return cls(float(spec))  # a NumPy scalar (np.float32(3e-2), from a dtype's eps) too
        raise TypeError(f"tolerance={spec!r}: expected a preset name, a positive float rtol, a Tolerance or a mapping "
                        "{site kind: one of those}")


TOLERANCE_PRESETS = {
    "float32": Tolerance(2e-3, 0.1, "float32", 1e-4),
    "float16": Tolerance(1e-2, 0.1, "float16", 2.5e-3),
    "bfloat16": Tolerance(3e-2, 0.1, "bfloat16", 3e-2),
    "quantised": Tolerance(1e-1, 0.1, "quantised", 5e-2),
}


def head_floors(config) -> dict:
    """{per-head site kind: the head scale below which its downstream norm no longer rescales} (module
    docstring): sqrt(eps) of the KDA output norm (rms_norm_eps) for `kda.o`, `kda.state`, `kda.v`, the v rows
    of `kda.conv_out` (an RMS norm: a head's largest entry is at least its rms); sqrt(eps / K) of the q/k L2 norm
    for its q and k rows ([3, 1], broadcast over the heads: x / sqrt(sum x^2 + eps) rescales a head fully once
    |x| > sqrt(eps), which a head of K entries reaches with its largest entry at sqrt(eps / K)); none for
    `mla.probs` (a softmax row sums to 1: its largest entry is at least 1/(t + 1))."""
    K = int(config.linear_attn_config.head_dim)
    o_norm, l2 = math.sqrt(float(config.rms_norm_eps)), math.sqrt(L2NORM_EPS / K)
    return {"kda.conv_out": np.array([[l2], [l2], [o_norm]]), "kda.v": o_norm, "kda.state": o_norm, "kda.o": o_norm,
            "mla.probs": 0.0}


class SiteErrors(NamedTuple):
    """`site_errors`' result, per token [T]: max_abs, rel; worst, the flat index into the token's value of the entry
    with the largest error against its scale (its own head's, where the site is judged per head; the first NaN, where
    one side only is NaN; -1 where no entry differs, and for top-k ids); over, how many entries are beyond the kind's
    rtol (top-k ids: how many ids differ)."""

    max_abs: np.ndarray
    rel: np.ndarray
    worst: np.ndarray
    over: np.ndarray


def site_errors(kind: str, ours: list, theirs: list, tol: Tolerance, head_floor=0.0) -> SiteErrors:
    """Per token (max_abs [T], rel [T], worst [T], over [T]: `SiteErrors`) of `theirs` against `ours` at one site
    (`kind` = the name without its layer prefix). Each list holds one array per token, ours and theirs of one shape.
    A kind in `HEAD_AXES` is judged per head, each head's scale floored at `head_floor` (a float, or an
    array broadcast over the head axes; `head_floors(config)[kind]`)."""
    T, tol = len(ours), tol.for_kind(kind)
    max_abs, rel = np.zeros(T), np.zeros(T)
    worst, over = np.full(T, -1, np.int64), np.zeros(T, np.int64)
    if kind.endswith(IDS_SITE):
        for t in range(T):
            a, b = set(np.asarray(ours[t]).tolist()), set(np.asarray(theirs[t]).tolist())
            max_abs[t] = len(a ^ b) / 2
            rel[t] = max_abs[t] / max(len(a), 1)
        return SiteErrors(max_abs, rel, worst, max_abs.astype(np.int64))
    tiny = float(np.finfo(np.float32).tiny)
    mags = np.array([float(_finite_max_abs(np.asarray(r, np.float64))) for r in ours])
    site_mag = np.maximum.accumulate(mags) if T else mags  # the site's largest magnitude up to each token
    axes, head_mag = HEAD_AXES.get(kind), None
    for t in range(T):
        r = np.asarray(ours[t], np.float64)
        o = np.asarray(theirs[t], np.float64)
        d = _differences(r, o)
        if not r.size:
            continue
        max_abs[t] = float(np.max(d))
        scale = max(mags[t], tol.floor * site_mag[t], tiny)
        if axes is None or r.ndim <= axes:
            e = d.reshape(-1) / scale
        else:
            heads = r.shape[:axes]
            m = _finite_max_abs(r.reshape(heads + (-1,)), axis=-1)
            head_mag = m if head_mag is None else np.maximum(head_mag, m)  # each head's largest magnitude so far
            head_scale = np.maximum(np.maximum(m, tol.floor * head_mag), np.minimum(head_floor, scale))
            e = (d.reshape(heads + (-1,)) / np.maximum(head_scale, tiny)[..., None]).reshape(-1)
        rel[t] = float(np.max(e))
        over[t] = int(np.count_nonzero(~(e <= tol.rtol)))
        if not max_abs[t] <= 0:  # an entry differs (or is NaN on one side: argmax gives the first NaN)
            worst[t] = int(np.argmax(e))
    return SiteErrors(max_abs, rel, worst, over)


def _differences(r: np.ndarray, o: np.ndarray) -> np.ndarray:
    """|o - r|, 0 where both hold the same NaN or infinity (a NaN on one side only stays NaN)."""
    with np.errstate(invalid="ignore"):  # inf - inf
        return np.where((o == r) | (np.isnan(o) & np.isnan(r)), 0.0, np.abs(o - r))


def _finite_max_abs(x: np.ndarray, axis=None):
    """The largest |entry| over the finite entries (0 where there are none)."""
    return np.max(np.abs(x), axis=axis, where=np.isfinite(x), initial=0.0)


def beyond(kind: str, rel, rtol: float) -> np.ndarray:
    """Where the relative errors `rel` (from `site_errors` for site kind `kind`) are beyond tolerance: a NaN
    always; top-k ids as soon as one id differs (their rel, the fraction of ids that differ, is not an rtol's)."""
    rel = np.asarray(rel)
    if kind.endswith(IDS_SITE):
        return ~(rel == 0)
    return ~(rel <= rtol)
