"""Replays that record every site, optionally with another engine's values patched in through hooks.

`replay(weights, tokens, sites, patch=None, probe=None, prefill=0)` runs `kimi_forward_token` token by token from
a fresh state (the first `prefill` tokens as one pass of the sequence path) with ONE hook on every site of
`sites`; at each firing, for each token, in this order:

    1. probe.replace(site, value)   a variant of the operation (e.g. another eps), when a probe is given
    2. record a copy of the value   what kimi_explore computed at this site, from the inputs it was given
    3. patch                        return the other engine's value for this token, if it has one
    4. probe.capture(site, value)   the value that flows on downstream (the other engine's, if patched)

With `patch` = everything the other engine captured, each site's recorded value is kimi_explore's
operation applied to the OTHER engine's inputs (teacher forcing): whatever is upstream of a site and
captured, including the previous token's state, is the other engine's. If that still disagrees with
the other engine's value, the operation itself differs (local); if it agrees, the site only
inherited differences from upstream. One replay answers this for every site and token at once.
"""

from __future__ import annotations

import numpy as np

from ..backend import to_numpy

__all__ = ["replay"]


def replay(weights, tokens, sites, patch=None, probe=None, prefill: int = 0, start: int = 0) -> dict:
    """{site: [value at token t for t in range(start, T)]} (host arrays; `mla.probs` padded to [nh, T]).

    tokens: the T token ids. sites: the hook names to record. patch: {site: [T - start, ...] other values}
    (per-token shapes as in `engines.dump`; row i is position start + i). probe: an object with
    `replace(site, value, t)` and `capture(site, value, t)` (see `operations.EpsProbe`), or None. prefill: the first
    `prefill` tokens run as one pass of the sequence path (`kimi_forward_sequence`, chunk = prefill), as an engine's
    prefill did; the rest are stepped. The hook then sees each site once for those tokens, [prefill, ...] rows, and
    steps 1-4 run row by row (a site of the recurrent state, `kda.conv` or `kda.state`, runs its layer token by
    token, as any hook there does). start: the tokens before it (the other engine did not capture them) are neither
    recorded nor patched (the probe runs at every token); those after the prefill run as one more pass.
    """
    from ..inspection.hooks import Hooks

    xp = getattr(weights, "xp", np)
    T = len(tokens)
    sites = set(sites)
    patch = patch or {}
    recorded = {s: [None] * (T - start) for s in sites}

    def one(name, value, t):
        if probe is not None:
            value = probe.replace(name, value, t)
        if name in sites and t >= start:
            ours = np.array(to_numpy(value), copy=True)
            if name.endswith("mla.probs"):  # [nh, t+1] (a chunk's row: [nh, L0 + T'], zeros after t) -> [nh, T]
                padded = np.zeros(ours.shape[:-1] + (T,), ours.dtype)
                padded[..., : ours.shape[-1]] = ours
                ours = padded
            recorded[name][t - start] = ours
        if name in patch and t >= start:
            new = np.asarray(patch[name][t - start])
            if name.endswith("mla.probs"):
                new = new[..., : value.shape[-1]]
            value = xp.asarray(new.astype(value.dtype, copy=False))
        if probe is not None:
            probe.capture(name, value, t)
        return value

    def hook(value, *, hook):
        if hook.positions is None:  # one token (stepped, or a chunk's layer run token by token)
            return one(hook.name, value, hook.position)
        given = [value[i] for i in range(len(hook.positions))]
        rows = [one(hook.name, v, int(t)) for v, t in zip(given, to_numpy(hook.positions), strict=True)]
        return xp.stack(rows) if any(r is not v for r, v in zip(rows, given, strict=True)) else value

    hooks = Hooks().bind(weights)
    # a probe reads its inputs at sites of its own (`kda.conv_out`, `attn.in`): then every site is hooked
    hooks.add(hook, names_filter=(lambda n: True) if probe is not None else (lambda n: n in sites or n in patch),
              chunks=True)
    state = weights.new_state()
    if prefill:
        weights.forward_sequence(state, [int(t) for t in tokens[:prefill]], hooks, chunk=prefill)
    if start > prefill:  # the uncaptured tokens after it in one pass: their route only rounds the state the rest read
        weights.forward_sequence(state, [int(t) for t in tokens[prefill:start]], hooks, chunk=start - prefill)
    for t in range(max(prefill, start), T):
        hooks.begin_token(int(tokens[t]), t)
        weights.forward_token(state, int(tokens[t]), hooks)
    return recorded
