"""Selected MXFP4 experts times a vector, straight from the packed bytes (CPU, compiled kernel).

    y[n, r] = sum_c W_{ids[n]}[r, c] * x[n, c]      W: the dequantised expert (mxfp4.py)

At K3 size the 16 experts a token picks are 280 MB packed and 2.1 GB dequantised; dequantising
them into memory and reading them back costs ~20x the packed bytes. The kernel
(`_mxfp4_matvec.c`) decodes each 16-byte group in registers instead: every weight is its exact
dequantised value, the group's power of two scales the group's partial sum (a scale byte of 253..255,
where dequantised weights overflow float32 to inf, or NaN for 0 x 2^128, multiplies the decoded weights
instead, as `mxfp4.dequantize` holds them), and only the float32
summation order differs from BLAS on the dequantised matrix (|error| ~1e-7 of sum |W x|, tested
against float64). It is built at install when a C compiler is present (`setup.py`, optional);
without it `AVAILABLE` is False and `experts.PackedExperts` dequantises instead.

The sequence path multiplies GROUPS of input rows, each group by its own expert (`grouped_matmat`,
`grouped_parts_matmat`, `grouped_ggml_matmat` for llama.cpp's blocks: a chunk's selections grouped by
expert). The expert's bytes come from memory once per call, and the power of two multiplies the decoded
weight (the exact dequantised value), so each output is a float32 dot product with the dequantised
matrix, summed in the kernel's order. A group of fewer than 12 inputs decodes each weight once per tile
of up to 5 inputs; a larger one decodes a tile of 64 rows x 256 columns once into float32 panels and
multiplies them as BLAS does (outer products: `_panels_avx2.h`, `_panels_avx512.h`).
"""

from __future__ import annotations

import numpy as np

from ..backend import HOST_THREADS, on_host
from .kernel_isa import check_apart, first_mismatch, first_sound, small_exact_inputs
from .workspace import run_parts, run_rows

try:
    from . import _mxfp4_matvec as _ext
except ImportError:  # no compiler at install time
    _ext = None

AVAILABLE = _ext is not None
_MIN_ROWS_PER_THREAD = 256


def runs(xp, dtype) -> bool:
    """Whether the kernel can take arrays of namespace `xp` computing in `dtype` (host, float32, built)."""
    return AVAILABLE and on_host(xp) and np.dtype(dtype) == np.float32


def isas() -> tuple[str, ...]:
    """Kernels this CPU can run, best last ('portable', 'avx2', 'avx512f'); () without the extension."""
    return _ext.isas() if AVAILABLE else ()


_DEFAULT: list = []  # the default kernel, once checked


def default_isa() -> str:
    """The kernel every entry point runs when none is asked for: the best of `isas()` that gives the portable
    kernel's floats on `_self_check` (`kernel_isa`: checked once, before the first product)."""
    if not _DEFAULT:
        _require()
        _DEFAULT.append(first_sound("mxfp4_matvec", isas(), _self_check))
    return _DEFAULT[0]


def _self_check(isa: str) -> str | None:
    """None when `isa` gives the portable kernel's floats through every entry point, else what differed. Codes
    of every value, scales 2^-2 .. 2^3, inputs of small integers: every sum exact. 37 rows and 288 columns
    cross the tiles' and panels' edges. The groups' sizes run every compiled shape the grouped entries can
    reach: the tiles' passes of 1-5 inputs (groups of 1-5), AVX2's panel calls of 1-5 (12, 13, 16, 19: 5 + 5 + 2,
    ...) and AVX-512's of 6-12 (12, 13, 16, 19, 21: 7 + 6, 8 + 8, 10 + 9, 11 + 10), and an empty group."""
    rng = np.random.default_rng(0)
    E, R, C = 3, 37, 288
    packed = rng.integers(0, 256, (E, R, C // 2), dtype=np.uint8)
    scale = rng.integers(125, 131, (E, R, C // 32), dtype=np.uint8)
    blocks = rng.integers(0, 256, (E, R, C // 32, 17), dtype=np.uint8)
    blocks[..., 0] = scale
    sizes = [1, 0, 2, 3, 4, 5, 12, 13, 16, 19, 21]
    bounds = np.cumsum([0, *sizes]).tolist()
    x = small_exact_inputs(bounds[-1], C)
    ids, experts = [2, 0, 2], [i % E for i in range(len(sizes))]
    parts = lambda a, picks: [(a[e, :20], a[e, 20:]) for e in picks]  # noqa: E731
    calls = {
        "expert_matvec": lambda i: expert_matvec(packed, scale, ids, x[:3], isa=i, threads=1),
        "expert_matvec (one input)": lambda i: expert_matvec(packed, scale, ids, x[0], isa=i, threads=1),
        "parts_matvec": lambda i: parts_matvec(parts(packed, ids), parts(scale, ids), (20, 17), x[:3], isa=i, threads=1),
        "ggml_expert_matvec": lambda i: ggml_expert_matvec(blocks, ids, x[:3], isa=i, threads=1),
        "grouped_matmat": lambda i: grouped_matmat(packed, scale, experts, bounds, x, isa=i, threads=1),
        "grouped_parts_matmat": lambda i: grouped_parts_matmat(parts(packed, experts), parts(scale, experts), (20, 17),
                                                               bounds, x, isa=i, threads=1),
        "grouped_ggml_matmat": lambda i: grouped_ggml_matmat(blocks, experts, bounds, x, isa=i, threads=1),
    }
    return first_mismatch(isa, calls)


def expert_matvec(packed, scale, ids, x, out=None, isa: str | None = None, threads: int | None = None, pool=None):
    """packed: uint8 [E, R, C/2]; scale: uint8 [E, R, C/32]; ids: [k] expert ids;
    x: float32 [C] (the same input for every expert) or [k, C] -> float32 [k, R].

    isa: one of `isas()` (default: `default_isa()`, the best that passes its self-check). threads: how many
    host threads share the rows (default: `backend.HOST_THREADS`); the kernel releases the GIL. pool: the
    executor they run on (the model's `workspace.pool()`; None: a pool just for this call).
    """
    _require()
    isa = isa or default_isa()
    for name, a in (("packed", packed), ("scale", scale)):
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 3 or not a.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous uint8 NumPy array [E, R, n], got {_describe(a)}")
    E, R, H = packed.shape
    if H % 16 or scale.shape != (E, R, H // 16):
        raise ValueError(f"packed {packed.shape} / scale {scale.shape}: expected [E, R, C/2] / [E, R, C/32], C a multiple of 32")
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    xeo, out = _inputs(x, len(ids), R, H, out)
    run = lambda a, b: _ext.expert_matvec(packed, scale, ids, xeo, out, R, H, a, b, isa)  # noqa: E731
    run_rows(pool, run, len(ids) * R, threads or HOST_THREADS, _MIN_ROWS_PER_THREAD)
    return out


def parts_matvec(packed, scale, rows, x, out=None, isa: str | None = None, threads: int | None = None, pool=None):
    """The same product for k experts that are not one array: each selected expert's matrix given as
    row blocks wherever they lie (views of memory-mapped shards: `mapped_experts`).

    packed, scale: k sequences (one per selected expert, in order) of P uint8 arrays, block p
    [rows[p], C/2] and [rows[p], C/32]; rows: the P block heights (w13: (I, I), w1 then w3);
    x: float32 [C] or [k, C] -> float32 [k, sum(rows)]. Bit for bit what `expert_matvec` gives on
    the same bytes stacked into a bank (the same row kernel); the sizes are checked in C.
    """
    _require()
    isa = isa or default_isa()
    rows = tuple(int(r) for r in rows)
    k = len(packed)
    if k == 0 or len(scale) != k or any(len(p) != len(rows) or len(s) != len(rows) for p, s in zip(packed, scale, strict=True)):
        raise ValueError(f"packed/scale: expected as many experts (>= 1; got {k} and {len(scale)}), "
                         f"each {len(rows)} row blocks")
    H = np.shape(packed[0][0])[-1]  # C/2; every block's size is checked against it in C
    xeo, out = _inputs(x, k, sum(rows), H, out)
    flat_p, flat_s = [a for p in packed for a in p], [a for s in scale for a in s]
    run = lambda a, b: _ext.parts_matvec(flat_p, flat_s, rows, xeo, out, H, a, b, isa)  # noqa: E731
    run_rows(pool, run, k * sum(rows), threads or HOST_THREADS, _MIN_ROWS_PER_THREAD)
    return out


def ggml_expert_matvec(blocks, ids, x, out=None, isa: str | None = None, threads: int | None = None, pool=None):
    """The same product from ggml's MXFP4 block layout (llama.cpp GGUF), read in place.

    blocks: uint8 [E, R, C/32, 17] (C-contiguous: a bank, or a view of the mapped GGUF); ids: [k];
    x: float32 [C] or [k, C] -> float32 [k, R]. Bit for bit what `expert_matvec` gives on the
    compressed-tensors bytes of the same weights (the C kernel puts each row's nibbles in that
    order in an L1 scratch and runs the same row kernel; `ggml_quants` has the layout).
    """
    _require()
    isa = isa or default_isa()
    _check_blocks(blocks)
    E, R, G, _ = blocks.shape
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    xeo, out = _inputs(x, len(ids), R, 16 * G, out)
    run = lambda a, b: _ext.ggml_matvec(blocks, ids, xeo, out, R, 16 * G, a, b, isa)  # noqa: E731
    run_rows(pool, run, len(ids) * R, threads or HOST_THREADS, _MIN_ROWS_PER_THREAD)
    return out


def grouped_matmat(packed, scale, experts, bounds, x, out=None, isa: str | None = None, threads: int | None = None,
                   pool=None):
    """packed: uint8 [E, R, C/2]; scale: uint8 [E, R, C/32]; experts: [m] expert ids; bounds: [m + 1] (group j =
    input rows bounds[j]..bounds[j+1]-1, bounds[0] = 0, bounds[-1] = n); x: float32 [n, C] -> float32 [n, R]:

        out[i] = W_{experts[j]} x[i]   for every i of group j

    isa, threads, pool: as `expert_matvec` (threads share the (group, row) range, cut by work).
    """
    _require()
    isa = isa or default_isa()
    for name, a in (("packed", packed), ("scale", scale)):
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 3 or not a.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous uint8 NumPy array [E, R, n], got {_describe(a)}")
    E, R, H = packed.shape
    if H % 16 or scale.shape != (E, R, H // 16):
        raise ValueError(f"packed {packed.shape} / scale {scale.shape}: expected [E, R, C/2] / [E, R, C/32], C a multiple of 32")
    experts = np.ascontiguousarray(experts, dtype=np.int64).reshape(-1)
    bounds, x, xeo, out = _group_inputs(bounds, len(experts), x, R, H, out)
    run = lambda a, b: _ext.grouped_matmat(packed, scale, experts, bounds, xeo, x, out, R, H, a, b, isa)  # noqa: E731
    run_parts(pool, run, _group_cuts(bounds, R, threads or HOST_THREADS))
    return out


def grouped_parts_matmat(packed, scale, rows, bounds, x, out=None, isa: str | None = None, threads: int | None = None,
                         pool=None):
    """`grouped_matmat` for experts given as row blocks wherever they lie (`parts_matvec`'s layout): packed,
    scale: m sequences (one per group, in order) of P uint8 arrays [rows[p], C/2] / [rows[p], C/32]."""
    _require()
    isa = isa or default_isa()
    rows = tuple(int(r) for r in rows)
    m = len(packed)
    if m == 0 or len(scale) != m or any(len(p) != len(rows) or len(s) != len(rows) for p, s in zip(packed, scale, strict=True)):
        raise ValueError(f"packed/scale: expected as many groups (>= 1; got {m} and {len(scale)}), each {len(rows)} row blocks")
    H = np.shape(packed[0][0])[-1]
    R = sum(rows)
    bounds, x, xeo, out = _group_inputs(bounds, m, x, R, H, out)
    flat_p, flat_s = [a for p in packed for a in p], [a for s in scale for a in s]
    run = lambda a, b: _ext.grouped_parts_matmat(flat_p, flat_s, rows, bounds, xeo, x, out, H, a, b, isa)  # noqa: E731
    run_parts(pool, run, _group_cuts(bounds, R, threads or HOST_THREADS))
    return out


def grouped_ggml_matmat(blocks, experts, bounds, x, out=None, isa: str | None = None, threads: int | None = None,
                        pool=None):
    """`grouped_matmat` from ggml's MXFP4 block layout (llama.cpp GGUF), read in place: blocks uint8 [E, R, C/32, 17].
    Bit for bit what `grouped_matmat` gives on the compressed-tensors bytes of the same weights (each row is put in
    that order in a small scratch as the kernel reaches it)."""
    _require()
    isa = isa or default_isa()
    _check_blocks(blocks)
    E, R, G, _ = blocks.shape
    experts = np.ascontiguousarray(experts, dtype=np.int64).reshape(-1)
    bounds, x, xeo, out = _group_inputs(bounds, len(experts), x, R, 16 * G, out)
    run = lambda a, b: _ext.grouped_matmat(blocks, None, experts, bounds, xeo, x, out, R, 16 * G, a, b, isa)  # noqa: E731
    run_parts(pool, run, _group_cuts(bounds, R, threads or HOST_THREADS))
    return out


def _check_blocks(blocks) -> None:
    if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8 or blocks.ndim != 4 or blocks.shape[-1] != 17 \
            or not blocks.flags.c_contiguous:
        raise ValueError(f"blocks: expected a C-contiguous uint8 NumPy array [E, R, C/32, 17], got {_describe(blocks)}")


def _group_inputs(bounds, m: int, x, R: int, H: int, out):
    """bounds checked; x [n, C] (C-contiguous, for the panels) and deinterleaved ([n, 2, H], for the tiles); `out` [n, R]
    checked or made."""
    bounds = np.ascontiguousarray(bounds, dtype=np.int64).reshape(-1)
    x = np.asarray(x)
    if len(bounds) != m + 1 or bounds[0] != 0 or np.any(np.diff(bounds) < 0):
        raise ValueError(f"bounds: expected [0, ..., n] non-decreasing, one more than the {m} groups; got {bounds.tolist()}")
    n = int(bounds[-1])
    if x.dtype != np.float32 or x.shape != (n, 2 * H):
        raise ValueError(f"x: expected float32 [{n}, {2 * H}] (n = bounds[-1]), got {_describe(x)}")
    x = np.ascontiguousarray(x)
    xeo = np.empty((n, 2, H), np.float32)
    xeo[:, 0] = x[:, 0::2]
    xeo[:, 1] = x[:, 1::2]
    out = np.empty((n, R), np.float32) if out is None else out
    if out.shape != (n, R) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out: expected a C-contiguous float32 [{n}, {R}], got {_describe(out)}")
    check_apart(out, x)  # the panels read x while they write out
    return bounds, x, xeo, out


_TILE_ROWS = 4  # weight rows per tile in the C kernel: cuts fall on whole tiles
_ROW_COST = 2  # decoding a weight row costs about as much as this many input rows through it


def _group_cuts(bounds, R: int, threads: int) -> list[tuple[int, int]]:
    """The flat (group, row) range [0, m R) cut into at most `threads` parts of equal work (a row of group j
    costs its input count plus `_ROW_COST`); fewer parts when there is little work."""
    sizes = np.diff(bounds) + _ROW_COST
    m = len(sizes)
    cum = np.concatenate(([0], np.cumsum(sizes * R)))  # work before group j
    parts = max(1, min(threads, int(cum[-1]) // (_MIN_ROWS_PER_THREAD * (1 + _ROW_COST))))
    cuts = [0]
    for p in range(1, parts):
        target = cum[-1] * p / parts
        j = min(m - 1, int(np.searchsorted(cum, target, side="right")) - 1)
        r = min(R, -(-int(target - cum[j]) // int(sizes[j])))
        r = min(R, -(-r // _TILE_ROWS) * _TILE_ROWS)
        cuts.append(max(cuts[-1], j * R + r))
    cuts.append(m * R)
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a] or [(0, m * R)]


def _require() -> None:
    if not AVAILABLE:
        raise RuntimeError("kimi_explore.weights._mxfp4_matvec was not built (no C compiler at install); reinstall with one")


def _inputs(x, k: int, R: int, H: int, out):
    """x deinterleaved for the kernel, [1 or k, 2, H] = [x[0::2] | x[1::2]] per input; `out` checked or made."""
    x = np.asarray(x)
    if x.dtype != np.float32 or x.shape[-1] != 2 * H or x.ndim not in (1, 2) or (x.ndim == 2 and x.shape[0] != k):
        raise ValueError(f"x: expected float32 [{2 * H}] or [{k}, {2 * H}], got {_describe(x)}")
    xeo = np.empty((1 if x.ndim == 1 else k, 2, H), np.float32)
    xeo[:, 0] = x[..., 0::2]
    xeo[:, 1] = x[..., 1::2]
    out = np.empty((k, R), np.float32) if out is None else out
    if out.shape != (k, R) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out: expected a C-contiguous float32 [{k}, {R}], got {_describe(out)}")
    return xeo, out


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} {a.shape}{'' if a.flags.c_contiguous else ' (not C-contiguous)'}"
    return type(a).__name__
