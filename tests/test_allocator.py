"""The sequence path's host arrays are reused from the heap, not faulted in afresh at every chunk (`model.allocator`)."""

import os
import platform
import subprocess
import sys

import pytest

# glibc's settings that fix the threshold (it then never moves, and settle() changes nothing), by environment variable
FIXED = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")
pytestmark = [
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the mmap threshold is glibc's"),
    pytest.mark.skipif(any(f"MALLOC_{n.upper()}_" in os.environ or f"glibc.malloc.{n}" in os.environ.get("GLIBC_TUNABLES", "")
                           for n in FIXED), reason="the environment fixes glibc's mmap threshold"),
]

# page faults of a second 508-token feed at chunk 128 without a recorder, in a new process ("off": settle() skipped)
SCRIPT = """
import resource, sys
import kimi_explore as ke
from kimi_explore.model import allocator
if sys.argv[1] == "off":
    allocator.settle = lambda: None
w = ke.from_pretrained(ke.tiny_checkpoint(), device="cpu")
ids = list(range(1, 255)) * 2
ke.Session(w, recorder=False).feed(ids, chunk=128, progress=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ke.Session(w, recorder=False).feed(ids, chunk=128, progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_a_feed_after_the_first_faults_no_pages_in():
    """After the first chunk of a process, a feed's arrays come from the heap: a handful of page faults, where
    without `settle` glibc maps and unmaps each array above its starting threshold (~800-3,600 faults here)."""
    assert _faults("on") < 100
    assert _faults("off") > 300  # (the control: what the test would see if settle() did nothing)
