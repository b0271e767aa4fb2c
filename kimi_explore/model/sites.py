"""How the token form reaches the hooks at one layer's sites: `site_table(hooks, names)`.

A layer binds its site names once (`KimiDecoderLayerWeights.names`: kind -> "layers.{i}.kind"). Per
token the decoder asks the hooks object once per layer for the sites something listens to, as a
dict kind -> fn(value) -> value, and fires only those:

    at = site_table(hooks, layer.names)
    if "attn.in" in at:
        x = at["attn.in"](x)

so a site nobody listens to costs one dict membership test (TransformerLens's HookPoints: a module
without hooks costs nothing). A hooks object with a `sites(names)` method (`Hooks`, `Recorder`,
`HookChain`) answers from its cache, rebuilt when its hooks change; any other object with
`fire(name, value) -> value` gets every site, each through its `fire`.
"""

from __future__ import annotations

import functools

# the table without hooks: nothing listens (shared by every layer: never written; a plain dict, whose
# membership test is the cheapest)
NO_SITES: dict = {}

__all__ = ["NO_SITES", "site_table"]


def site_table(hooks, names) -> dict:
    """{kind: fn(value) -> value} for the sites of `names` ({kind: full name}) that `hooks` listens to."""
    if hooks is None:
        return NO_SITES
    own = getattr(hooks, "sites", None)
    table = own(names) if own is not None else None
    if table is None:
        fire = hooks.fire
        table = {kind: functools.partial(fire, name) for kind, name in names.items()}
    return table
