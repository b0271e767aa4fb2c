"""Shared fixtures: the reference checkpoint (Moonshot's outputs) and the random tiny model (`tiny_weights`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"
REFERENCE_DIR = DATA / "reference" / "tiny_k3"
REFERENCE_NPZ = DATA / "reference" / "tiny_k3_expected.npz"


def undigested(path) -> dict:
    """A kimi_explore .npz's entries without its `digests`: what a file written before them holds (edited and
    written back, its entries meet each one's own checks, not the digests)."""
    with np.load(path) as z:
        return {k: z[k] for k in z.files if k != "digests"}


@pytest.fixture(scope="session")
def ref():
    with np.load(REFERENCE_NPZ) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="session")
def ref_weights():
    from kimi_explore import from_pretrained

    return from_pretrained(REFERENCE_DIR, device="cpu")


@pytest.fixture(scope="session")
def tiny_weights():
    from kimi_explore import from_pretrained
    from kimi_explore.weights.tiny_model import random_tiny_checkpoint

    return from_pretrained(random_tiny_checkpoint(), device="cpu")


@pytest.fixture(scope="session")
def trained_weights():
    """The embedded trained tiny model (package data), float32 on the host."""
    from kimi_explore import from_pretrained
    from kimi_explore.weights.tiny_model import tiny_checkpoint

    return from_pretrained(tiny_checkpoint(), device="cpu")


def require_kernel():
    """Skip without the compiled MXFP4 kernel, unless KIMI_EXPLORE_REQUIRE_KERNEL=1 (.ci/run): then fail."""
    from kimi_explore.weights import mxfp4_matvec

    if not mxfp4_matvec.AVAILABLE:
        if os.environ.get("KIMI_EXPLORE_REQUIRE_KERNEL") == "1":
            pytest.fail("kimi_explore.weights._mxfp4_matvec was not built, and KIMI_EXPLORE_REQUIRE_KERNEL=1")
        pytest.skip("the compiled MXFP4 kernel was not built (no C compiler at install)")


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for one test module (2 CPUs, no dashboard, loopback only), shut down after it; a module asks for
    it with `pytestmark = pytest.mark.usefixtures("local_ray")`."""
    import gc

    ray = pytest.importorskip("ray")
    for attempt in range(3):  # Ray gives its node 30 s to register (not configurable): a loaded machine can miss that
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            break
        except Exception as e:
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
    yield ray
    gc.collect()  # Ray handles held by garbage (state finalizers, graph refs) go while Ray is still up
    ray.shutdown()


@pytest.fixture
def ckpt(tmp_path):
    """A private copy of the random tiny model (5 shards) to break."""
    import shutil

    from kimi_explore.weights.tiny_model import random_tiny_checkpoint

    dst = tmp_path / "ckpt"
    shutil.copytree(random_tiny_checkpoint(), dst)
    return dst
