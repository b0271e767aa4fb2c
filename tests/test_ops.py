"""The row forms in ops: `linear` (x W^T for arrays and bf16 matrices) and `dense_mlp_sequence`."""

from __future__ import annotations

import numpy as np
import pytest
from test_modules import as64

from kimi_explore import from_pretrained
from kimi_explore.model.ops import dense_mlp, dense_mlp_sequence, linear
from kimi_explore.weights.tiny_model import tiny_checkpoint


@pytest.mark.parametrize("model", ["ref_weights", "trained_weights"], ids=["reference", "trained"])
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-13)], ids=["float32", "float64"])
def test_dense_mlp_sequence_equals_rows_of_the_token_form(request, model, dtype, tol):
    weights = request.getfixturevalue(model)
    w = weights.layers[0].ffn
    w = as64(w) if dtype == np.float64 else w
    c = weights.config
    xs = np.random.default_rng(0).standard_normal((9, w.gate_up_proj.shape[1])).astype(dtype)
    got = dense_mlp_sequence(xs, w, c.activation_situ_beta, c.activation_situ_linear_beta)
    want = np.stack([dense_mlp(x, w, c.activation_situ_beta, c.activation_situ_linear_beta) for x in xs])
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


def test_linear_on_arrays_and_bf16_matrices():
    rng = np.random.default_rng(1)
    W = rng.standard_normal((30, 20))
    x = rng.standard_normal((4, 20))
    np.testing.assert_allclose(linear(x, W), np.stack([W @ r for r in x]), rtol=0, atol=1e-13)
    np.testing.assert_allclose(linear(x[0], W), W @ x[0], rtol=0, atol=1e-13)  # one row: [C] -> [R]
    bf16 = from_pretrained(tiny_checkpoint(), device="cpu", weight_dtype="bfloat16")
    M = bf16.lm_head
    xs = rng.standard_normal((3, M.shape[1])).astype(np.float32)
    want = xs.astype(np.float64) @ np.asarray(M).astype(np.float64).T
    np.testing.assert_allclose(linear(xs, M), want, rtol=0, atol=1e-5 * np.abs(want).max())
