"""Losing a pipeline stage on purpose, for the tests and the hand-run fuzz."""

from __future__ import annotations

import time


def kill_stage(pipe, k: int) -> None:
    """ray.kill stage k's actor and wait until it is gone: ray.kill returns before the process has died, so a
    call made right after may still be served by it (seen on a loaded 2-core machine)."""
    import ray

    actor = pipe.stages[k].actor
    ray.kill(actor)
    while True:
        try:
            ray.get(actor.ping.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
