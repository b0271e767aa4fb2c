"""Review of tonight's speed-ups (MLA query blocks, the AVX2 KDA columns, the vpshufb MXFP4 row kernel, chunks of
512 and the session's chunk replayer): each test's expected values come from an independent reference (a float64
dequantised matvec, the float64 recurrence, stepping), and the ones marked 'failed before its fix' did."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_kernel

from kimi_explore.weights import mxfp4, mxfp4_matvec


def _float64_rows(packed, scale, x):
    """Row r of the one expert: the float64 dequantised weights times float64 x (inf/NaN as float64 gives them)."""
    W = mxfp4.naive_dequantize(packed[0], scale[0])
    with np.errstate(all="ignore"):
        return (W * x.astype(np.float64)).sum(axis=1)


def _mxfp4_kernels():
    return mxfp4_matvec.isas() if mxfp4_matvec.AVAILABLE else ("portable",)


@pytest.mark.parametrize("isa", _mxfp4_kernels())
def test_mxfp4_group_sums_above_half_the_float_range(isa):
    """A group whose products sum to 1e38..3e38 (finite in float32) at scales 126..128: the float64 value, not inf.
    Failed before its fix (avx2): the row kernel summed twice the weights and halved the scale, so any group sum
    above 1.7e38 overflowed to inf, whatever the scale (x = 2e38 times a weight of 1 gave inf at scale 126)."""
    require_kernel()
    C = 64
    packed = np.zeros((1, 6, C // 2), np.uint8)
    packed[0, :, 0] = 0x02  # column 0: 1.0
    packed[0, 3:, 1] = 0x03  # column 2: 1.5 (rows 3..5)
    scale = np.array([126, 127, 127, 126, 127, 126], np.uint8).reshape(1, 6, 1).repeat(2, axis=2)
    x = np.zeros(C, np.float32)
    x[0], x[2] = 2e38, 6e37  # rows 0..2: 2e38 * 1 * 2^(s-127); rows 3..5: + 9e37, below FLT_MAX
    x[35] = 1.0  # the second group: 0 there
    want = _float64_rows(packed, scale, x)
    assert np.all(np.abs(want) < np.finfo(np.float32).max)
    got = mxfp4_matvec.expert_matvec(packed, scale, [0], x, isa=isa, threads=1)[0]
    assert np.all(np.isfinite(got)), got
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("isa", _mxfp4_kernels())
def test_mxfp4_every_code_scale_and_special_input(isa):
    """Every byte value (all 16 codes at both nibbles) at scales 0, 1, 127, 128, 254 (an expert each, x scaled so that
    the row stays finite), times x holding -0, subnormals, inf or NaN: the float64 dequantised matvec's value to
    float32 rounding where it is finite, its inf (with its sign) or NaN otherwise; at scale 255 (2^128: inf in
    float32, as mxfp4.py) with integer x: each group's exact sum times inf, summed (NaN or the signed inf)."""
    require_kernel()
    C = 512  # 256 bytes per row: every byte value once
    rng = np.random.default_rng(7)
    scales = [0, 1, 127, 128, 254, 255]
    packed = np.stack([rng.permutation(256).astype(np.uint8) for _ in scales])[:, None]  # [E, 1, 256]
    scale = np.array(scales, np.uint8)[:, None, None].repeat(C // 32, axis=2)  # [E, 1, 16]
    x_scale = np.float32([1, 1, 1, 1, 2.0**-120, 1])
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    for special in (None, -0.0, tiny, 37 * tiny, np.inf, -np.inf, np.nan):
        x = rng.standard_normal((len(scales), C)).astype(np.float32) * x_scale[:, None]
        x[-1] = rng.integers(-3, 4, C)  # scale 255: integer x, exact group sums in any order
        if special is not None:
            x[:-1, rng.choice(C, 9, replace=False)] = special
        got = mxfp4_matvec.expert_matvec(packed, scale, np.arange(len(scales)), x, isa=isa, threads=1)[:, 0]
        for e in range(len(scales) - 1):
            want = _float64_rows(packed[e : e + 1], scale[e : e + 1], x[e])[0]
            W = mxfp4.naive_dequantize(packed[e, 0:1], scale[e, 0:1])
            with np.errstate(invalid="ignore"):
                err_scale = (np.abs(W) @ np.abs(x[e].astype(np.float64)))[0]
            if np.isfinite(want):
                assert abs(got[e] - want) <= 1e-6 * err_scale + 1e-43, (special, scales[e], got[e], want)
            else:
                assert np.array_equal(got[e], np.float32(want), equal_nan=True), (special, scales[e], got[e], want)
        codes = mxfp4.naive_dequantize(packed[-1, 0:1], np.full((1, C // 32), 127, np.uint8))[0]  # the E2M1 values
        group_sums = (codes * x[-1].astype(np.float64)).reshape(-1, 32).sum(axis=1)
        with np.errstate(invalid="ignore"):
            want255 = (group_sums * np.inf).sum()
        assert np.array_equal(got[-1], np.float32(want255), equal_nan=True), (special, got[-1], want255)
