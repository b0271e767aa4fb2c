"""`ke.compare(session, other)`: where does another K3 engine part from the model, and why?

    cmp = ke.compare(session, "llamacpp_f32experts_decode.npz", names="llama.cpp")
    cmp.first      # Divergence(token=0, layer=0, site='layers.0.kda.state', local=True, operation='KDA q/k L2 norm', ...)

Steps:
1. `other` becomes {hook name: [T, ...]} (a mapping, an engine dump, or llama.cpp captures through
   `name_maps.llamacpp_to_hooks`); its tokens must be the session's (an empty session is fed them).
2. kimi_explore replays the tokens from a fresh state, recording the sites the other engine has
   (`patching.replay`), and each site and token is judged against the tolerance model (`tolerance.py`,
   per head where a per-head norm follows).
3. Local or inherited: one more replay with every captured value of the other engine patched in
   (teacher forcing; top-k weights only with their ids) records kimi_explore's operation at each of
   those sites on the other engine's inputs; a site that diverges and is still beyond tolerance there
   (at the same token) is local.
4. Local sites that a known variant can explain (`operations.PROBES`: an eps) are replayed with the
   variant, recording those sites only: the eps at which the other engine's values are matched is reported.
Only the dumped sites are recorded (each replay holds T copies of every site it records: `kda.state` alone
is 0.43 GB per token at K3's size), never every hook site.
Refused up front: weights of a layer subset that cannot compute a dumped site as the whole model does,
and expert ids that are not this model's.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..backend import to_numpy
from ..inspection._hook_grammar import LAYER_NAME, LAYER_SUFFIXES, _why_not
from ..inspection.npz_io import NpzReader
from ..inspection.targets import int_in
from ..model.config import FINAL_SITES
from .comparison import Comparison, SiteComparison
from .dump import Dump, read_dump, token_ids
from .name_maps import llamacpp_prefill, llamacpp_to_hooks
from .operations import PROBES, candidates, input_graph, operation_of, probe_sites
from .patching import replay
from .tolerance import IDS_SITE, SiteErrors, Tolerance, beyond, head_floors, site_errors

__all__ = ["compare", "load_other"]

_LLAMACPP = ("llama.cpp", "llamacpp")
_LAYER_SITE = re.compile(r"layers\.(\d+)\.")


def compare(session, other, *, names=None, tolerance=None, local: bool = True, probes: bool = True,
            prefill: int | None = None, start: int | None = None) -> Comparison:
    """Compare another engine's values with kimi_explore's at every site they both have.

    session: a `Session` on the same weights (its tokens; an empty session is fed the other engine's, once the
    comparison has run, as `compare_routing` feeds it: a report or the Explorer then shows the tokens compared).
    other: {hook name: [T, ...]}, a `Dump`, a dump file (.safetensors), or llama.cpp captures (an .npz
    path, mapping or dump, with names="llama.cpp"). names: None (keys are hook names), "llama.cpp", a mapping
    {other name: hook name}, or a function arrays -> {hook name: array}. tolerance: a preset name, a
    float rtol, a `Tolerance` (default: the dump's dtype, else "float32"), or a mapping {site kind: any of those}
    whose kinds are judged by their own (e.g. {"kda.decay": 0.1}; the key "default": the rest). local: run the
    teacher-forced replay that tells local from inherited. probes: try the known variants on local sites.
    prefill: the other engine ran its first `prefill` tokens as one prefill (a prefill capture: all of them): they are
    replayed as one pass of the sequence path, the rest stepped (default: the dump's metadata 'prefill', else what
    llama.cpp captures show: a prefill capture all T, a mixed one its `mixed_prefill_len`; else 0: every token
    stepped, as a decode). The two routes agree to float32 rounding; this one compares a prefill with the route
    that computes as one. start: the other engine's values begin at this position (row i is token start + i; default:
    the dump's metadata 'start', else 0), the tokens before it uncaptured (a prompt before the decode it captured): they
    are run to build the state the rest read, and compared nowhere; every token the comparison names is a position.
    """
    if not (hasattr(session, "weights") and hasattr(session, "tokens")):
        raise TypeError(f"compare: session must be a Session on the weights (ke.Session(weights)), got "
                        f"{type(session).__name__} {session!r:.40}")
    weights = _in_process(session.weights)
    sources: dict = {}  # hook name -> the llama.cpp name(s) it was made from
    arrays, tokens, engine, dtype, dumped, start = load_other(other, names=names, weights=weights, sources=sources,
                                                              start=start)
    tokens = _tokens(session, tokens)
    prefill = int_in(dumped if prefill is None else prefill, 0, len(tokens), "compare: prefill",
                     " (the first tokens the other engine ran as one prefill)")
    start = int_in(start, 0, max(len(tokens) - 1, 0), "compare: start",
                   " (the position of the other engine's first captured token)")
    tol = Tolerance.of(tolerance if tolerance is not None else dtype, default=dtype)
    order = _hook_names(weights)
    _check_tolerance_kinds(tol, weights, order)
    _check_layers(weights, arrays)
    _check_names(arrays, order)
    sites = [n for n in order if n in arrays]
    if not sites:
        raise ValueError("compare: the other engine's values name no site of this model (nothing to compare); "
                         "expected hook names (ke.hook_names(weights)) or names='llama.cpp'")
    scores = [s.replace(IDS_SITE, "moe.router.scores") for s in sites if s.endswith(IDS_SITE)]  # (near ties)
    theirs = {s: arrays[s] for s in sites}
    named = {s: f"{s!r} (llama.cpp's {sources[s]})" if s in sources else repr(s) for s in sites}
    _check_rows(theirs, len(tokens), start, named)
    ours = replay(weights, tokens, sites + scores, prefill=prefill, start=start)  # the dumped sites (and their ids' scores)
    if names is None:  # hook-named values may come from a Trace, whose attention rows are NaN after the position
        theirs = _without_trace_padding(theirs, start)
    _check_shapes(ours, theirs, named)
    _check_expert_ids(theirs, weights.config.num_experts, named, start)
    theirs = {s: np.asarray(a).astype(np.int64) if s.endswith(IDS_SITE) else a for s, a in theirs.items()}  # (whole numbers)

    floors, graph, at = head_floors(weights.config), input_graph(order, weights.config), {s: i for i, s in enumerate(order)}
    _check_state_layout(ours, theirs, tol, floors, named)
    results = {}
    for s in sites:
        layer, kind = _split(s)
        a, b, experts = _aligned(s, ours, theirs, ours_ids=ours.get(s.replace("topk_weights", "topk_ids")))
        err = site_errors(kind, a, b, tol, floors.get(kind, 0.0))
        results[s] = SiteComparison(s, layer, kind, err.max_abs, err.rel, operation=_operation(s, kind, at, theirs, graph),
                                    shape=_named_shape(kind, a, weights.config), worst=err.worst, over=err.over, experts=experts,
                                    start=start)
    for s in sites:
        if s.endswith(IDS_SITE) and (bad := np.flatnonzero(beyond(IDS_SITE, results[s].rel, 0.0))).size:
            results[s].explanation = _tie(weights, s, int(bad[0]), ours, theirs, tol, start)
    del ours
    for s in sites:
        if s.endswith("mla.probs") and (late := _attends_ahead(theirs[s], start)):
            results[s].explanation = (f"the other engine gives probability to positions after the token's own at {len(late)} "
                                      f"token(s), first token {late[0]}: its causal mask lets a token see later ones")
    cmp = Comparison(results, tol, tokens, engine, weights.config, prefill, start)
    if local:
        patch = _patch(theirs)
        forced = replay(weights, tokens, sites, patch=patch, prefill=prefill, start=start)
        window, notes = weights.config.linear_attn_config.short_conv_kernel_size, {}
        for s, r in results.items():
            err, r.local_experts = _local_errors(s, r.kind, forced, theirs, tol, floors)
            r.local_rel, r.local_worst = err.rel, err.worst
            if start and (untested := _reads_uncaptured(s, theirs, graph, len(r.rel), window))[0]:
                n, what = untested
                r.local_from = n
                rows = "any captured position" if n == len(r.rel) else f"positions {start}..{start + n - 1}"
                notes[s] = (f"its operation reads {what} of the tokens before position {start}, which the other engine "
                            f"did not capture (kimi_explore's own there): local or inherited not tested at {rows}")
        del forced
        if probes:
            _run_probes(cmp, weights, tokens, theirs, patch, tol, floors, prefill, start)
        for s, note in notes.items():
            results[s].explanation = "; ".join(filter(None, [results[s].explanation, note]))
    if not session.tokens:
        session.feed(tokens, progress=False)
    return cmp


def load_other(other, *, names=None, weights=None, sources=None, start=None) -> tuple[dict, list | None, str, str, int, int]:
    """(arrays {hook name: [T - start, ...]}, tokens or None, engine, dtype, prefill, start) from anything `compare`
    takes (prefill: a dump's where its metadata says (0 too), else llama.cpp captures' own
    (`name_maps.llamacpp_prefill`), else 0; start: the one given, else a dump's, else 0).
    sources: a dict filled with the llama.cpp name(s) of each hook name (`name_maps.llamacpp_to_hooks`). start:
    compare's (a dump file is read with it where its metadata does not say)."""
    engine, dtype, tokens, prefill, given = "", "float32", None, None, start
    start = 0 if given is None else given
    if isinstance(other, (str, Path)):
        path = Path(other)
        if not path.is_file():
            raise FileNotFoundError(f"compare: other={str(path)!r}: no such file")
        if path.suffix == ".npz":
            with NpzReader(path, "captures") as z:  # (a damaged entry or archive: an error naming the file)
                other = {k: z[k] for k in z.files}
            engine = path.stem
        else:
            other = read_dump(path, given)
    if isinstance(other, Dump):
        start = other.start if given is None else given
        if names is None:
            return dict(other.arrays), list(other.tokens), other.engine, other.dtype, other.prefill or 0, start
        engine, dtype, prefill = other.engine, other.dtype, other.prefill  # under the other engine's names: mapped below
        other = {**other.arrays, "tokens": np.asarray(other.tokens)}
    if not isinstance(other, Mapping):
        raise TypeError(f"compare: other must be a mapping, a Dump or a path, got {type(other).__name__}")
    if "tokens" in other:
        tokens = token_ids(other["tokens"], "compare: the other engine's 'tokens'")
    if isinstance(names, str):
        if names not in _LLAMACPP:
            raise ValueError(f"compare: names={names!r}; expected 'llama.cpp', a mapping, a function or None")
        if weights is None:
            raise ValueError("compare: llama.cpp captures need the weights (for the config and the MLA latent norms)")
        arrays = llamacpp_to_hooks(other, weights.config, weights, sources, start)
        return arrays, tokens, engine or "llama.cpp", dtype, llamacpp_prefill(other, weights.config, start) if prefill is None \
            else prefill, start
    if callable(names):
        arrays = dict(names(other))
    elif isinstance(names, Mapping):
        arrays = {names[k]: v for k, v in other.items() if k in names}
        seen: dict = {}
        for k in other:
            if k in names and (dup := seen.setdefault(names[k], k)) != k:
                raise ValueError(f"compare: names maps both {dup!r} and {k!r} onto {names[k]!r}; one value per site")
    elif names is None:
        arrays = {k: v for k, v in other.items() if k not in ("tokens",)}
    else:
        raise TypeError(f"compare: names={names!r}; expected 'llama.cpp', a mapping, a function or None")
    return arrays, tokens, engine, dtype, prefill or 0, start


def _in_process(weights):
    """The weights, refused where their hooks run elsewhere: a RayPipeline runs hooks in its stages, where a replay
    cannot record what kimi_explore computes before the other engine's value is patched in (each crashed in its
    shape check: nothing came back)."""
    try:
        return weights.local_weights()
    except TypeError:
        raise TypeError("compare: a RayPipeline runs hooks in its stages, so compare's replays cannot record what "
                        "kimi_explore computes there before patching the other engine's values in; compare over weights "
                        "in this process: ke.compare(ke.Session(ke.from_pretrained(path)), other) (K3's experts mapped "
                        "from disk fit one host: experts='mapped')") from None


def _hook_names(weights) -> list[str]:
    from ..model.kimi_decoder import hook_names

    return hook_names(weights)


def _tokens(session, theirs) -> list[int]:
    ours = [int(t) for t in session.tokens]
    if not ours:
        if theirs is None:
            raise ValueError("compare: the session has no tokens and the other engine's values carry none: feed the "
                             "session the token ids the other engine ran")
        if not theirs:
            raise ValueError("compare: the other engine's values carry 0 token ids: nothing to compare")
        V = session.weights.config.vocab_size
        bad = [(i, t) for i, t in enumerate(theirs) if t >= V]
        if bad:  # (fed to the session below, it would fail inside the model, naming neither)
            raise ValueError(f"compare: the other engine's 'tokens' hold id {bad[0][1]} at position {bad[0][0]}, outside "
                             f"this model's vocabulary 0..{V - 1}: another model's tokenizer ran")
        return list(theirs)
    if theirs is not None and list(theirs) != ours:
        n = min(len(ours), len(theirs))
        diff = next((i for i in range(n) if ours[i] != theirs[i]), n)
        prefix = diff == len(ours) < len(theirs)
        raise ValueError(f"compare: the other engine ran other tokens: {len(theirs)} ids against the session's {len(ours)}, "
                         + (f"which are its first {len(ours)}: feed the session the rest (session.feed(ids[{len(ours)}:])), "
                            "or compare on an empty session" if prefix else f"first difference at position {diff}"))
    return ours


def _check_names(arrays, order) -> None:
    known = set(order)
    bad = [k for k in arrays if k not in known]
    if bad:
        hints = [_hint(k, order) for k in bad[:5]]
        raise KeyError(f"compare: {len(bad)} key(s) of the other engine are not hook names of this model: {', '.join(hints)}"
                       f"{' ...' if len(bad) > 5 else ''}; see ke.hook_names(weights) (llama.cpp captures: names='llama.cpp')")


def _hint(key: str, order) -> str:
    """A key that is no hook name of this model: a site its layer does not have (a KDA site of an MLA layer: the
    layer's own sites, not a KDA site of another layer), else the closest name."""
    m = LAYER_NAME.match(key)
    if m and m.group(2) in LAYER_SUFFIXES:
        return f"{key!r} ({_why_not(key, order)})"
    close = difflib.get_close_matches(key, order, 1)
    return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)


def _tie(weights, site: str, t: int, ours, theirs, tol: Tolerance, start: int) -> str:
    """Whether the first token where the other engine selected other experts is a near tie in kimi_explore's
    selection scores (the router's scores plus its bias): the experts only kimi_explore selected score above the
    ones only the other engine did by how much, against the largest score and the scores' rtol."""
    layer = int(site.split(".")[1])
    ffn = next(lw.ffn for lw in weights.layers if lw.index == layer)  # (held: `_check_layers`)
    scores = np.asarray(ours[site.replace(IDS_SITE, "moe.router.scores")][t], np.float64)
    biased = scores + np.asarray(to_numpy(ffn.e_score_correction_bias), np.float64)
    a, b = set(np.asarray(ours[site][t]).tolist()), set(np.asarray(theirs[site][t]).tolist())
    mine, other = sorted(a - b), sorted(e for e in b - a if 0 <= e < biased.size)
    if not mine or not other:
        return ""
    gap = float(biased[mine].min() - biased[other].max())
    rel, rtol = gap / max(float(np.abs(biased).max()), np.finfo(np.float32).tiny), tol.for_kind("moe.router.scores").rtol
    what = "a near tie" if rel <= rtol else "not a tie"
    return (f"{what} at token {start + t}: kimi_explore's selection scores (router scores + bias) put expert(s) {mine} {gap:.3g} "
            f"above the other engine's {other}, {rel:.2g} of the largest score (the scores' rtol: {rtol:g})"
            + ("; a rounding difference upstream can decide it" if rel <= rtol else ""))


def _check_tolerance_kinds(tol: Tolerance, weights, order: list) -> None:
    """Refuse a tolerance for a site kind the loaded layers have none of (a typo judged nothing), or for one layer's
    site."""
    kinds = list(dict.fromkeys(_split(s)[1] for s in order))
    for kind, _ in tol.kinds:
        if kind in kinds:
            continue
        layer, own = _split(kind) if _LAYER_SITE.match(kind) else (None, kind)
        hint = (f"; a tolerance is per kind, for every layer's site: give {own!r}" if layer is not None and own in kinds
                else f"; did you mean {close[0]!r}?" if (close := difflib.get_close_matches(kind, kinds, 1)) else "")
        held = list(weights.layer_ids)
        which = ("this model has" if held == list(range(weights.config.num_hidden_layers))
                 else f"the loaded layers {held} have")
        raise ValueError(f"compare: tolerance names site kind {kind!r}, which {which} none of{hint} (their kinds: "
                         f"{', '.join(kinds)})")


def _check_layers(weights, arrays) -> None:
    """Refuse sites these weights cannot compute as the whole model does. Layer i's sites read every earlier
    layer (through the AttnRes sources), so they are the model's only where the weights hold layers 0..i (a
    prefix: `layers=range(k)`); the output sites (`final.*`, `logits`) only where they hold every layer. Else
    another model would be compared: an engine that agrees looked local at `layers.3.attn.in` (layers=[3, 4]),
    or the AttnRes weights had another number of sources."""
    held, n = list(weights.layer_ids), weights.config.num_hidden_layers
    if held == list(range(n)):
        return
    wrong, skipped = [], set()
    for s in arrays:
        if m := _LAYER_SITE.match(s):
            needs = range(int(m[1]) + 1)  # the layer and every one before it
        elif s in FINAL_SITES:
            needs = range(n)
        else:
            continue  # "embed", or a name that `_check_names` refuses
        missing = [i for i in needs if i not in held]
        if missing:
            wrong.append((len(needs), s))
            skipped.update(missing)
    wrong = [s for _, s in sorted(wrong, key=lambda w: w[0])]  # the earliest layer first
    if wrong:
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise ValueError(
            f"compare: the weights hold only layers {held} of the model's {n}, while the other engine ran the whole model: "
            f"its {', '.join(map(repr, wrong[:3]))}{more} depend on layer(s) {sorted(skipped)} that these weights leave out, "
            "so kimi_explore would compute another model there. Load every layer (ke.from_pretrained(path)), or a prefix "
            "layers=range(k) and compare only the sites of layers 0..k-1 (no final.* or logits)")


def _check_rows(theirs, T: int, start: int, named: dict) -> None:
    """One row per token from `start` (before anything is replayed)."""
    for s, a in theirs.items():
        shape = np.shape(a)
        if not shape or shape[0] != T - start:
            means = T - shape[0] if shape and 0 < shape[0] <= T else None  # the start its rows would mean
            if start:
                hint = f" (the positions {start}..{T - 1} of the {T} tokens: start={start}" + (
                    f"; its {shape[0]} rows would mean start={means})" if means is not None else ")")
            elif means:
                hint = (f"; where the other engine captured only its last {shape[0]} tokens, say where they begin: "
                        f"compare(..., start={means})")
            else:
                hint = ""
            raise ValueError(f"compare: {named[s]} has shape {shape}, expected one row per token ({T - start}){hint}")


def _check_shapes(ours, theirs, named: dict) -> None:
    for s, a in theirs.items():
        a = np.asarray(a)
        want = ours[s][0].shape
        if a.shape[1:] != want:
            hint = (f" (a row spans every position 0..{want[-1] - 1}, zeros after the token's own)"
                    if s.endswith("mla.probs") and a.ndim == 3 and a.shape[1:-1] == want[:-1] else "")
            raise ValueError(f"compare: {named[s]} has per-token shape {a.shape[1:]}, kimi_explore's is {want}{hint}")


def _check_expert_ids(theirs, num_experts: int, named: dict, start: int) -> None:
    """The other engine's top-k ids are experts of this model. The forced replay routes to them: an id out of
    range failed there, in a hook, naming neither the dump nor the token."""
    for s, a in theirs.items():
        if not s.endswith(IDS_SITE):
            continue
        a = np.asarray(a)
        if a.dtype.kind not in "iuf":
            raise ValueError(f"compare: the other engine's {named[s]} is {a.dtype}; expected integer expert ids "
                             f"0..{num_experts - 1}")
        bad = np.argwhere(~((a >= 0) & (a < num_experts) & (a == np.floor(a))))  # NaN too
        if bad.size:
            t, j = (int(x) for x in bad[0])
            raise ValueError(f"compare: the other engine's {named[s]} holds expert id {a[t, j].item()!r} at token {start + t} "
                             f"(slot {j}; {len(bad)} such id(s) in all); this model's experts are the integers "
                             f"0..{num_experts - 1}")
        for t, row in enumerate(a.reshape(len(a), -1)):  # (compared as sets, a repeat read as half an id differing)
            ids, counts = np.unique(row, return_counts=True)
            if (counts > 1).any():
                e = ids[counts > 1][0].item()
                raise ValueError(f"compare: the other engine's {named[s]} selects expert {int(e)} more than once at token "
                                 f"{start + t} (slots {np.flatnonzero(row == e).tolist()}: {row.tolist()}); a top-k "
                                 f"selection names {row.size} distinct experts, so the other engine's top-k repeats one")


def _check_state_layout(ours, theirs, tol, floors, named) -> None:
    """A KDA state written [H, V, K] (mlx-lm's layout, for one) where the format's is [H, K, V]: square heads pass the
    shape check, and the comparison then blamed the state's operation (and patched the transposed state into the
    replay, so every later kda.o looked local). Refused where the state differs as written but agrees transposed."""
    for s in theirs:
        if not s.endswith("kda.state"):
            continue
        b = [np.asarray(x) for x in theirs[s]]
        if b[0].shape[-1] != b[0].shape[-2]:
            continue
        rel = site_errors("kda.state", ours[s], b, tol, floors.get("kda.state", 0.0)).rel
        if not beyond("kda.state", rel, tol.for_kind("kda.state").rtol).any():
            continue
        rel_t = site_errors("kda.state", ours[s], [x.swapaxes(-1, -2) for x in b], tol, floors.get("kda.state", 0.0)).rel
        if not beyond("kda.state", rel_t, tol.for_kind("kda.state").rtol).any():
            raise ValueError(f"compare: the other engine's {named[s]} agrees with kimi_explore's transposed (largest "
                             f"relative error {np.nanmax(rel_t):.2g}, against {np.nanmax(rel):.2g} as written): it holds each "
                             "head's state as [V, K] (mlx-lm's layout, for one); the dump format's is [H, K, V] (S with k in, "
                             "v out: o = S^T q), so swap its last two axes")


def _patch(theirs) -> dict:
    """What the teacher-forced replay patches in: every value of the other engine, except top-k weights whose ids
    it did not dump. Those are listed in its own order (llama.cpp's: by biased score), which need not be
    kimi_explore's; forced onto kimi_explore's ids they weight the wrong experts, and every routed-experts site
    of an engine that agrees looked local. Left out, the replay computes the weights of the ids it routes to."""
    ids = {s.replace(IDS_SITE, "moe.router.topk_weights") for s in theirs if s.endswith(IDS_SITE)}
    return {s: v for s, v in theirs.items() if not s.endswith("moe.router.topk_weights") or s in ids}


def _named_shape(kind: str, a, config) -> tuple:
    """One token's value shape as `comparison.AXES` names it: the short-conv window's channels [3, P, W] split into
    [3, H, K, W] (channel h K + j is head h's channel j, as kda.conv_out names it)."""
    shape = np.shape(a[0]) if a else ()
    heads = config.linear_attn_config.num_heads
    if kind == "kda.conv" and len(shape) == 3 and shape[1] % heads == 0:
        return (shape[0], heads, shape[1] // heads, shape[2])
    return shape


# sites whose operation the next captured site's description already names (the conv window, the q/k L2
# norms), or where nothing is computed (the sealed blocks): a dump may leave them out
_FOLDED = ("kda.conv", "kda.q", "kda.k", "final.block_residual")


def _span(site, captured, graph) -> list[str]:
    """The sites not in the dump that `site`'s operation reads through (`operations.input_graph`, walked back to dumped
    sites): a teacher-forced replay runs their operations too. Only what it reads: a dumped site beside its path
    (top-k ids, beside the experts' input) bounds nothing, and one it reads through several paths (the sealed blocks,
    which every AttnRes mix reads) bounds only the path through it."""
    skipped, todo, seen = [], list(graph[site]), set()
    while todo:
        s = todo.pop()
        if s in seen or s in captured:
            continue
        seen.add(s)
        skipped.append(s)
        todo.extend(graph[s])
    return skipped


def _reads_uncaptured(site, captured, graph, rows: int, window: int) -> tuple[int, str]:
    """(n, what): the first n captured rows of `site` run an operation that reads state of the tokens before the dump's
    start, which the forced replay cannot patch (kimi_explore's own prompt: an engine's drift or bug there looked
    local): the MLA cache (every row attends to the prompt's keys and values); the KDA recurrent state (the site's own
    update at its first row, whose previous state is the prompt's; every row where the state is not dumped: the
    recurrence keeps the prompt's part); the short-conv window (its own first row; the first window - 1 rows where the
    window is not dumped)."""
    n, what = 0, []
    for s in [site, *_span(site, captured, graph)]:
        kind, own = _split(s)[1], s == site
        if kind in ("mla.probs", "mla.o"):
            m, w = rows, "the MLA cache"
        elif kind == "kda.state":
            m, w = (1 if own else rows), "the KDA recurrent state"
        elif kind == "kda.conv":
            m, w = (1 if own else window - 1), "the short-conv window"
        else:
            continue
        n, what = max(n, m), [*what, w]
    return min(n, rows), " and ".join(dict.fromkeys(what))


def _operation(site, kind, at, captured, graph) -> str:
    """What kimi_explore computes at `site` from the other engine's values: its own operation, and every
    operation it reads through sites not in the dump (`_span`: a sparse dump cannot place a local difference closer
    than that)."""
    skipped = [s for s in _span(site, captured, graph) if _split(s)[1] not in _FOLDED]
    op = operation_of(kind)
    if not skipped:
        return op
    skipped.sort(key=at.__getitem__)
    listed = ", ".join(skipped) if len(skipped) <= 10 else f"{len(skipped)} sites, {skipped[0]} .. {skipped[-1]}"
    return f"{op}, and everything it reads that the dump lacks: {listed}"


def _split(site: str):
    parts = site.split(".", 2)
    if parts[0] == "layers":
        return int(parts[1]), parts[2]
    return None, site


def _without_trace_padding(theirs: dict, start: int) -> dict:
    """Attention probabilities whose every entry after token t's position is NaN (a Trace's padding of the rows
    [nh, t + 1]) with zeros there, as the dump format and kimi_explore's replay have the masked slots. Only a whole
    NaN tail: a NaN among masked slots that hold numbers is an engine's, and differs; llama.cpp's captures
    (zeros there, as masked) are never changed. Row i is position start + i."""
    out = dict(theirs)
    for site, v in theirs.items():
        if not site.endswith("mla.probs"):
            continue
        v = np.asarray(v)
        tails = [i for i in range(len(v)) if (tail := v[i][..., start + i + 1 :]).size and np.isnan(tail).all()]
        if tails:
            v = v.copy()
            for i in tails:
                v[i][..., start + i + 1 :] = 0.0
            out[site] = v
    return out


def _attends_ahead(probs, start: int) -> list[int]:
    """The positions t whose probabilities [heads, T] (row t - start) hold a number other than zero after position t
    (the format's masked slots; NaN there is not attention ahead: a softmax of a NaN row is NaN everywhere)."""
    tails = ((start + i, np.asarray(p)[..., start + i + 1 :]) for i, p in enumerate(probs))
    return [t for t, tail in tails if np.any((tail != 0) & np.isfinite(tail))]


def _aligned(site, ours, theirs, ours_ids=None):
    """Per-token lists (ours, theirs, experts) ready to compare. Top-k weights (ours selected by `ours_ids`) by expert
    id, over the experts either side selected, ascending (`experts` [T] lists them; a weight one side did not give is
    0: another expert weighted is a difference), engines list the same set in other orders; where the other engine
    dumped no ids, both sides largest first (experts None: the entries are ranks). Other sites as they are."""
    a, b, experts = list(ours[site]), [np.asarray(x) for x in theirs[site]], None
    if site.endswith("moe.router.topk_weights"):
        their_ids = theirs.get(site.replace("topk_weights", "topk_ids"))
        if their_ids is None:  # nothing to pair the weights by
            return [np.sort(x)[::-1] for x in a], [np.sort(x)[::-1] for x in b], None
        ours_ids, experts = their_ids if ours_ids is None else ours_ids, []
        for t in range(len(a)):
            mine, other = np.asarray(ours_ids[t], np.int64), np.asarray(their_ids[t], np.int64)
            union = np.union1d(mine, other)
            a[t], b[t] = _by_expert(a[t], mine, union), _by_expert(b[t], other, union)
            experts.append(union)
    return a, b, experts


def _by_expert(weights, ids, experts):
    """The top-k `weights` of expert `ids` placed at those experts in `experts` (sorted; 0 at the others)."""
    weights = np.asarray(weights)
    out = np.zeros(experts.shape, np.result_type(weights.dtype, np.float32))
    out[np.searchsorted(experts, ids)] = weights
    return out


def _local_errors(site, kind, forced, theirs, tol, floors) -> tuple[SiteErrors, list | None]:
    """(errors, experts of the top-k weights) of kimi_explore's operation on the other engine's inputs."""
    # in the forced replay the top-k weights are computed for the other engine's ids (patched in)
    ids = theirs.get(site.replace("topk_weights", "topk_ids")) if kind == "moe.router.topk_weights" else None
    a, b, experts = _aligned(site, forced, theirs, ours_ids=ids)
    return site_errors(kind, a, b, tol, floors.get(kind, 0.0)), experts


def _run_probes(cmp: Comparison, weights, tokens, theirs, patch, tol, floors, prefill: int, start: int) -> None:
    local = set(cmp.local_sites)
    for probe, (probe_class, _, own_eps) in PROBES.items():
        targets = [s for s in probe_sites(probe, cmp.sites) if s in local]
        if not targets:
            continue
        open_ = set(targets)
        for eps in candidates(own_eps, weights.config):
            # the probe reads its inputs at every site as they flow; only the sites it may explain are recorded
            forced = replay(weights, tokens, sorted(open_), patch=patch, probe=probe_class(weights, eps), prefill=prefill,
                            start=start)
            for s in sorted(open_):
                r = cmp.sites[s]
                rel = _local_errors(s, r.kind, forced, theirs, tol, floors)[0].rel[r.local_from :]
                if not np.any(beyond(r.kind, rel, tol.for_kind(r.kind).rtol)):
                    r.operation = probe  # named only where one of its variants explains the site
                    r.explanation = f"other engine matches eps {eps:g} (kimi_explore: {own_eps:g})"
                    open_.discard(s)
            if not open_:
                break
        for s in open_:
            cmp.sites[s].explanation = f"no eps in {[own_eps, *candidates(own_eps, weights.config)]} matches the other engine"
