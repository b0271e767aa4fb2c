"""The default SIMD kernel of the compiled matvecs is the best one that passes its self-check (`weights.kernel_isa`):
a kernel that gives other floats than the portable C kernel is skipped with a warning, never used silently."""

from __future__ import annotations

import numpy as np
import pytest

from kimi_explore.weights import bf16_matvec, mxfp4_matvec

MODULES = [m for m in (mxfp4_matvec, bf16_matvec) if m.AVAILABLE]


class _Broken:
    """The compiled module, but entry point `name` adds 1 to its first output when it runs kernel `isa` (its last
    argument): a kernel bug on one route, as an untested AVX-512 kernel could have."""

    def __init__(self, real, name: str, out_arg: int, isa: str):
        self.real, self.name, self.out_arg, self.isa = real, name, out_arg, isa

    def __getattr__(self, attr):
        fn = getattr(self.real, attr)
        if attr != self.name:
            return fn

        def broken(*args):
            result = fn(*args)
            if args[-1] == self.isa:
                args[self.out_arg].reshape(-1)[0] += 1.0
            return result
        return broken


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_the_best_kernel_passes_here(module, monkeypatch):
    monkeypatch.setattr(module, "_DEFAULT", [])
    assert module.default_isa() == module.isas()[-1]
    assert all(module._self_check(isa) is None for isa in module.isas())


@pytest.mark.parametrize(("module", "entry", "out_arg", "reported"), [
    (mxfp4_matvec, "grouped_matmat", 6, r"grouped_matmat: 1 of 3552 outputs differ, e\.g\. -?[0-9.]+ against"),
    (mxfp4_matvec, "ggml_matvec", 3, "ggml_expert_matvec: 1 of 111 outputs differ"),
    (bf16_matvec, "bf16_matmat", 2, r"bf16_matmat \(1 rows\): 1 of 37 outputs differ"),
], ids=["mxfp4-grouped", "mxfp4-ggml", "bf16-matmat"])
def test_a_kernel_that_disagrees_is_skipped_with_a_warning(module, entry, out_arg, reported, monkeypatch):
    if not module.AVAILABLE or len(module.isas()) < 2:
        pytest.skip("needs the compiled kernel and a SIMD one on this CPU")
    best = module.isas()[-1]
    monkeypatch.setattr(module, "_ext", _Broken(module._ext, entry, out_arg, best))
    monkeypatch.setattr(module, "_DEFAULT", [])
    message = rf"the {best} kernel disagrees with the portable C kernel on its self-check \({reported}"
    with pytest.warns(RuntimeWarning, match=message):
        assert module.default_isa() == module.isas()[-2]
    # the default route now gives the portable kernel's floats
    rng = np.random.default_rng(3)
    if module is mxfp4_matvec:
        packed = rng.integers(0, 256, (2, 8, 16), dtype=np.uint8)
        scale = np.full((2, 8, 1), 127, np.uint8)
        x = rng.standard_normal((3, 32)).astype(np.float32)
        run = lambda isa=None: mxfp4_matvec.grouped_matmat(packed, scale, [1, 0], [0, 1, 3], x, isa=isa)  # noqa: E731
    else:
        bits = np.ascontiguousarray((rng.standard_normal((8, 40)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
        x = rng.standard_normal((3, 40)).astype(np.float32)
        run = lambda isa=None: bf16_matvec.bf16_matmat(bits, x, isa=isa)  # noqa: E731
    np.testing.assert_array_equal(run(), run(module.isas()[-2]))


def test_the_route_names_the_kernel_that_runs(monkeypatch):
    """A model's expert route names the kernel its products take, the self-checked default: it named the CPU's
    best, also after that one had been skipped for disagreeing."""
    if not mxfp4_matvec.AVAILABLE or len(mxfp4_matvec.isas()) < 2:
        pytest.skip("needs the compiled kernel and a SIMD one on this CPU")
    from kimi_explore import from_pretrained
    from kimi_explore.weights.tiny_model import random_tiny_checkpoint

    weights = from_pretrained(random_tiny_checkpoint(), device="cpu", experts="packed", expert_cache_size=0)
    bank = next(layer.ffn.experts for layer in weights.layers if hasattr(getattr(layer, "ffn", None), "experts"))
    monkeypatch.setattr(mxfp4_matvec, "_DEFAULT", [mxfp4_matvec.isas()[-2]])  # as if the best had been skipped
    assert bank.route.startswith(f"fused MXFP4 kernel ({mxfp4_matvec.isas()[-2]}), no cache")

