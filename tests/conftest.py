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


def pytest_configure(config):
    """Under pytest-xdist, its workers (started after this) run OpenBLAS on one thread each: two workers of two threads
    on a 2-core machine spin on each other's cores. Set here, in the process that starts them, before they load NumPy:
    a RayPipeline's stages get the same count (`blas_threads_env`), so they sum as the worker that drives them."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
            os.environ.setdefault(var, "1")


_STARTS_RAY = ("ray.init", "local_ray", "RayPipeline", "pipeline_fuzz")


def pytest_collection_modifyitems(config, items):
    """For pytest-xdist's `--dist loadgroup` (.ci/run: two workers): each test module is one group, so its module
    fixtures are made once, and every module that starts a local Ray is in one group "ray", so no two Rays run at
    once on the 2-core machine."""
    starts_ray: dict[str, bool] = {}
    for item in items:
        path = str(item.path)
        if path not in starts_ray:
            text = Path(path).read_text(encoding="utf-8")
            starts_ray[path] = any(s in text for s in _STARTS_RAY)
        item.add_marker(pytest.mark.xdist_group("ray" if starts_ray[path] else item.path.stem))
