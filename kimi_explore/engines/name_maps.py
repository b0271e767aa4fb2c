"""llama.cpp's graph names -> `kimi_explore` hook names, per token.

llama.cpp's eval callback names each graph tensor `name-<il>` (il = 0-based layer; no suffix for
global tensors) and gives its shape as ggml's `ne = [ne0, ne1, ne2, ne3]`, fastest axis FIRST.
`ggml_to_numpy` turns a raw record into a NumPy array with the axes reversed (C order, fastest
axis last, trailing unit axes dropped), which is how the shared captures store them. A name that
fires more than once in one step is stored as `name#0`, `name#1`, ... in firing order.

`llamacpp_to_hooks(arrays, config, weights=None)` takes such arrays for T tokens (decode: one record
per token stacked on a leading axis; prefill: one record over all T tokens) and returns
{hook name: [T, ...] array in the hook's own per-token shape}:

    inp_embd                        -> embed
    attn_norm-i                     -> layers.i.attn.in
    stack(kda_{q,k,v}_conv-i)       -> layers.i.kda.conv_out  [T, 3, H, K] (before the q/k L2 norm)
    kda_v_conv-i                    -> layers.i.kda.v
    kda_beta-i [T, H, 1]            -> layers.i.kda.beta [T, H]
    exp(kda_g1-i)                   -> layers.i.kda.decay      (llama.cpp names the log decay g)
    sigmoid(kda_g2-i)               -> layers.i.kda.gate       (llama.cpp names the pre-activation)
    new_state-i [T, H, V, K]        -> layers.i.kda.state [T, H, K, V] (transposed; decode only)
    attn_output-i                   -> layers.i.kda.o
    norm-i#1 * q_a_layernorm        -> layers.i.mla.q_latent   (MLA layers; needs `weights`)
    norm-i#2 * kv_a_layernorm       -> layers.i.mla.kv_latent  (MLA layers; needs `weights`)
    kq_soft_max-i                   -> layers.i.mla.probs [T, nh, T] (position s > t is 0, as masked)
    kqv_mla-i                       -> layers.i.mla.o
    kda_out-i / mla_out-i           -> layers.i.attn.out; on a block boundary llama.cpp names the
                                       mixer output prefix_sum_attn-i instead (the sum restarts there)
    res_probs-i#0                   -> layers.i.attn_res.attn.weights
    res_probs-i#1 (res_probs-0)     -> layers.i.attn_res.ffn.weights
    ffn_norm-i                      -> layers.i.ffn.in
    ffn_moe_probs-i                 -> layers.i.moe.router.scores
    ffn_moe_topk-i                  -> layers.i.moe.router.topk_ids
    ffn_moe_weights_scaled-i        -> layers.i.moe.router.topk_weights
    ffn_moe_out-i                   -> layers.i.moe.experts_out (weighted sum, before the latent norm)
    ffn_out-i - ffn_shexp-i         -> layers.i.moe.routed_out (derived: exact to the float32 rounding of the sum)
    ffn_shexp-i                     -> layers.i.moe.shared_out
    ffn_out-i                       -> layers.i.ffn.out
    l_out-i                         -> layers.i.prefix_sum
    res_probs                       -> final.attn_res.weights
    result_norm                     -> final.hidden
    logits (or result_output)       -> logits

Not mapped (no kimi_explore site; `UNMAPPED`): the rms_norm records before their weight (`norm-i#k`, except the
MLA latents above, and the final `norm`), `kqv`, `kqv_out`, `mla_gated`, `v_cont`, `kq` (unscaled scores),
`kda_scan_out`, `kda_normed`, `prefix_sum_attn` off a block boundary, the router's and the experts' intermediates
(`ffn_moe_logits`, `ffn_moe_argsort`, ...). Any other name is refused: a renamed `l_out-i` was dropped, and
the comparison passed without its most telling site. kimi_explore sites llama.cpp does not name: `kda.conv`
(the window), `kda.q` and `kda.k` (llama.cpp names q/k only before their L2 norm), `final.block_residual`.
"""

from __future__ import annotations

import difflib
import re

import numpy as np

from ..backend import to_numpy

__all__ = ["LLAMACPP_GLOBAL", "UNMAPPED", "ggml_to_numpy", "llamacpp_prefill", "llamacpp_to_hooks", "parse_llamacpp_name"]

_NAME = re.compile(r"^(?P<base>[A-Za-z_][A-Za-z0-9_]*?)(?:-(?P<layer>\d+))?(?:#(?P<k>\d+))?$")

# global (no layer) names -> hook names
LLAMACPP_GLOBAL = {"inp_embd": "embed", "res_probs": "final.attn_res.weights", "result_norm": "final.hidden",
                   "logits": "logits"}
# what llama.cpp's K3 graph names and no kimi_explore site is (the module docstring), and what is read beside the arrays
UNMAPPED = frozenset({"norm", "kq", "kqv", "kqv_out", "mla_gated", "v_cont", "kda_scan_out", "kda_normed", "prefix_sum_attn",
                      "ffn_moe_logits", "ffn_moe_probs_biased", "ffn_moe_argsort", "ffn_moe_weights", "ffn_moe_weights_sum",
                      "ffn_moe_weights_sum_clamped", "ffn_moe_weights_norm", "ffn_moe_gate", "ffn_moe_up", "ffn_moe_situ",
                      "ffn_moe_down", "ffn_moe_weighted", "tokens", "mixed_prefill_len", "result_output"})
# per-layer names whose value maps as it is (after the per-token reshape)
_DIRECT = {"attn_norm": "attn.in", "kda_v_conv": "kda.v", "attn_output": "kda.o", "ffn_norm": "ffn.in",
           "ffn_moe_probs": "moe.router.scores", "ffn_moe_out": "moe.experts_out", "ffn_shexp": "moe.shared_out",
           "ffn_out": "ffn.out", "l_out": "prefix_sum"}


def parse_llamacpp_name(name: str) -> tuple[str, int | None, int | None]:
    """'norm-3#1' -> ('norm', 3, 1); 'l_out-0' -> ('l_out', 0, None); 'result_norm' -> ('result_norm', None, None)."""
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a llama.cpp graph name: expected 'name', 'name-<layer>' or 'name-<layer>#<k>'")
    layer, k = m.group("layer"), m.group("k")
    return m.group("base"), None if layer is None else int(layer), None if k is None else int(k)


# records that span the whole batch in a prefill capture: base -> (their rank there with more than one head, which
# head count: "kda", "mla" or None). A decode capture stacks one record per token: one more axis (MLA's [T, H, 1, n],
# two). ggml drops leading unit axes, so with one head a prefill's new_state is [V, K] and a decode's [T, V, K], and
# MLA's records read alike ([T, n]): those say nothing.
_BATCH_RECORDS = {"new_state": (3, "kda"), "v_cont": (2, None), "kq": (3, "mla"), "kq_soft_max": (3, "mla")}


def llamacpp_prefill(arrays, config=None, start: int = 0) -> int:
    """How many of the captured tokens llama.cpp ran as one prefill: a mixed capture's `mixed_prefill_len`; all T
    of a prefill capture, known by a record that spans the whole batch (`new_state-i` [H, V, K] after the last
    token, MLA's `kq_soft_max-i` [H, T, n], ...); else 0, a decode (one record per token). A prefill capture that
    holds none of those records (or one token) reads as a decode: the two replays agree to float32 rounding.
    config: the model's (its head counts; without it, more than one head is assumed). start: captures of the tokens from
    this position on (`llamacpp_to_hooks`) are per-token records: no batch record is read there."""
    T = int(np.asarray(arrays["tokens"]).shape[0]) if "tokens" in arrays else 0
    if "mixed_prefill_len" in arrays:
        n = np.asarray(arrays["mixed_prefill_len"])
        if n.shape != () or n.dtype.kind not in "iu" or not 0 <= int(n) <= T:
            raise ValueError(f"llama.cpp captures: 'mixed_prefill_len' must be a number of tokens 0..{T} (the tokens of "
                             f"the mixed run's first step), found {n!r:.60}")
        return int(n)
    heads = {"kda": config.linear_attn_config.num_heads if config is not None else 2,
             "mla": config.num_attention_heads if config is not None else 2, None: 2}
    for key in arrays:
        base = key.split("-", 1)[0]
        if T < 2 or start or base not in _BATCH_RECORDS or "-" not in key:
            continue
        rank, of = _BATCH_RECORDS[base]
        if heads[of] == 1:
            if of == "mla":
                continue
            rank -= 1
        if np.ndim(arrays[key]) == rank:
            return T
    return 0


def ggml_to_numpy(data, ne, dtype=np.float32) -> np.ndarray:
    """A ggml tensor's bytes (contiguous) and its `ne` (fastest axis first) -> a NumPy array in C order:
    shape reversed(ne[:n_dims]), trailing unit axes of `ne` dropped (ggml_n_dims)."""
    ne = [int(n) for n in ne]
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    a = np.frombuffer(data, dtype=dtype) if isinstance(data, (bytes, bytearray, memoryview)) else np.asarray(data, dtype)
    if a.size != int(np.prod(ne)):
        raise ValueError(f"ggml tensor: {a.size} values for ne={ne} (expected {int(np.prod(ne))})")
    return a.reshape(tuple(reversed(ne)))


def llamacpp_to_hooks(arrays, config, weights=None, sources: dict | None = None, start: int = 0) -> dict:
    """{llama.cpp name: array} for T tokens -> {kimi_explore hook name: [T - start, ...] array}.

    arrays: a mapping (an opened `llamacpp_<kind>_<mode>.npz`), with `tokens` [T]; decode captures
    (one record per token on a leading axis) or prefill captures (one record over the T tokens).
    config: the model's `KimiDecoderConfig` (which layer is KDA / MLA / a block boundary).
    weights: the loaded weights, for the MLA latents (llama.cpp names them before the norm weight);
    without them those two sites are left out. sources: a dict filled with {hook name: the llama.cpp name(s) it
    was made from}, for errors that name the capture. A name neither mapped nor in `UNMAPPED` is refused, and so
    is a known name in a form the mapping does not read (`l_out-5#0`, a layer-less `l_out`, `inp_embd-0`, a plain
    `res_probs-3` beside `res_probs-3#1`): dropped, the comparison would pass without it. start: the captures hold
    the tokens from this position on (`tokens` still every id: the attention rows span positions 0..T-1).
    """
    if "tokens" not in arrays:
        raise KeyError("llama.cpp captures: no 'tokens' array (the token ids fed, [T])")
    T = int(np.asarray(arrays["tokens"]).shape[0])
    R = T - start  # the captured rows
    read = set()

    def raw(key):
        """The array, with a one-token prefill capture's token axis put back: ggml drops a record's trailing unit
        axes (README: `reversed(ne[:n_dims])`), so a one-token batch's records come without it ([64], not [1, 64]),
        where a decode capture's per-token records are stacked on a leading axis of T = 1."""
        read.add(key)
        a = np.asarray(arrays[key])
        return a[None] if R == 1 and a.ndim and a.shape[0] != 1 else a
    by_layer: dict = {}
    out: dict = {}
    sources = {} if sources is None else sources
    _check_known(arrays)
    for key in arrays:
        if key in UNMAPPED:
            continue
        base, layer, k = parse_llamacpp_name(key)
        if layer is None:
            if k is None and base in LLAMACPP_GLOBAL:
                out[LLAMACPP_GLOBAL[base]] = _f32(raw(key))
                sources[LLAMACPP_GLOBAL[base]] = repr(key)
            continue
        by_layer.setdefault(layer, {})[base if k is None else f"{base}#{k}"] = key
    if "logits" not in out and "result_output" in arrays:
        out["logits"] = _f32(raw("result_output"))
        sources["logits"] = "'result_output'"
    layer_weights = {lw.index: lw for lw in getattr(weights, "layers", [])} if weights is not None else {}
    for i in sorted(by_layer):
        names = by_layer[i]

        def get(base, names=names):
            return _f32(raw(names[base]))

        p = f"layers.{i}."
        before = set(out)
        for base, site in _DIRECT.items():
            if base in names:
                out[p + site] = get(base)
        if all(f"kda_{c}_conv" in names for c in "qkv"):
            convs = [get(f"kda_{c}_conv") for c in "qkv"]
            if len({c.shape for c in convs}) != 1:
                raise ValueError("llama.cpp captures: " + ", ".join(f"{names[f'kda_{c}_conv']!r} {list(a.shape)}" for c, a
                                                                    in zip("qkv", convs, strict=True))
                                 + f": expected one shape, [{R} tokens, heads, head dim] each (layer {i}'s q, k and v)")
            out[p + "kda.conv_out"] = np.stack(convs, axis=1)
        if "kda_beta" in names:
            out[p + "kda.beta"] = get("kda_beta")[..., 0]
        if "kda_g1" in names:
            out[p + "kda.decay"] = np.exp(get("kda_g1"))
        if "kda_g2" in names:
            out[p + "kda.gate"] = 1.0 / (1.0 + np.exp(-get("kda_g2")))
        if "new_state" in names and raw(names["new_state"]).ndim == 4 and raw(names["new_state"]).shape[0] == R:
            out[p + "kda.state"] = get("new_state").swapaxes(-1, -2)  # llama.cpp [H, V, K]; ours [H, K, V]
        mixer = "kda_out" if "kda_out" in names else "mla_out"
        if mixer in names:
            out[p + "attn.out"] = get(mixer)
        elif config.is_block_boundary(i) and "prefix_sum_attn" in names:
            out[p + "attn.out"] = get("prefix_sum_attn")
        if "res_probs#0" in names:
            out[p + "attn_res.attn.weights"] = get("res_probs#0")
        ffn_res = "res_probs#1" if "res_probs#1" in names else "res_probs"
        if ffn_res in names:
            out[p + "attn_res.ffn.weights"] = get(ffn_res)
        if "ffn_moe_topk" in names:  # (as stored: `compare` checks they are whole numbers, then casts)
            out[p + "moe.router.topk_ids"] = raw(names["ffn_moe_topk"])
        if "ffn_moe_weights_scaled" in names:
            out[p + "moe.router.topk_weights"] = get("ffn_moe_weights_scaled")[..., 0]
        if "ffn_out" in names and "ffn_shexp" in names:
            out[p + "moe.routed_out"] = get("ffn_out") - get("ffn_shexp")
        if "kq_soft_max" in names:
            out[p + "mla.probs"] = _per_token_heads(get("kq_soft_max"), R, names["kq_soft_max"])[:, :, :T]
        if "kqv_mla" in names:
            out[p + "mla.o"] = _per_token_heads(get("kqv_mla"), R, names["kqv_mla"])
        lw = layer_weights.get(i)
        if lw is not None and lw.attention.kind == "mla":
            for k, site, norm in ((1, "mla.q_latent", "q_a_layernorm"), (2, "mla.kv_latent", "kv_a_layernorm")):
                if f"norm#{k}" in names:
                    gain, a = np.asarray(to_numpy(getattr(lw.attention, norm)), np.float32), get(f"norm#{k}")
                    if a.ndim != 2 or a.shape[1] != gain.shape[0]:
                        raise ValueError(f"llama.cpp captures: {names[f'norm#{k}']!r} has shape {list(a.shape)}, "
                                         f"expected [{R} tokens, {gain.shape[0]}] (layer {i}'s {site}, before its norm weight)")
                    out[p + site] = a * gain
        for site in set(out) - before:
            sources[site] = _source(site, i, names)
    unread = [key for key in arrays if key not in read and parse_llamacpp_name(key)[0] not in UNMAPPED]
    if unread:
        raise KeyError(f"llama.cpp captures: {len(unread)} name(s) llama.cpp's K3 graph gives, in a form the mapping "
                       f"does not read: {', '.join(map(repr, unread[:6]))}{' ...' if len(unread) > 6 else ''} (a global "
                       "name with a layer or '#k', a per-layer one without its layer or with a '#k' it never has, a plain "
                       "'res_probs-i' beside 'res_probs-i#1'); dropped, the comparison would pass without them. Name "
                       "them as llama.cpp does, or map them yourself (compare(..., names={their name: hook name}))")
    for name, a in out.items():
        if a.ndim == 0 or a.shape[0] != R:
            raise ValueError(f"llama.cpp captures: {name!r} (from {sources.get(name, '?')}) has shape {a.shape}, expected "
                             f"one row per token ({R}" + (f": positions {start}..{T - 1})" if start else ")")
                             + (f"; captures of the last {a.shape[0]} tokens only: compare(..., start={T - a.shape[0]})"
                                if not start and a.ndim and 0 < a.shape[0] < T else ""))
    return out


# which llama.cpp names each per-layer hook site is made of (for errors)
_MADE_OF = {**{site: (base,) for base, site in _DIRECT.items()}, "kda.conv_out": ("kda_q_conv", "kda_k_conv", "kda_v_conv"),
            "kda.beta": ("kda_beta",), "kda.decay": ("kda_g1",), "kda.gate": ("kda_g2",), "kda.state": ("new_state",),
            "attn.out": ("kda_out", "mla_out", "prefix_sum_attn"), "attn_res.attn.weights": ("res_probs#0",),
            "attn_res.ffn.weights": ("res_probs#1", "res_probs"), "moe.router.topk_ids": ("ffn_moe_topk",),
            "moe.router.topk_weights": ("ffn_moe_weights_scaled",), "moe.routed_out": ("ffn_out", "ffn_shexp"),
            "mla.probs": ("kq_soft_max",), "mla.o": ("kqv_mla",), "mla.q_latent": ("norm#1",), "mla.kv_latent": ("norm#2",)}


def _source(site: str, i: int, names: dict) -> str:
    kind = site[len(f"layers.{i}."):]
    return " and ".join(repr(names[b]) for b in _MADE_OF.get(kind, ()) if b in names) or "?"


# every name the mapping reads, or knows to have no site
_KNOWN = frozenset(LLAMACPP_GLOBAL) | UNMAPPED | {b.split("#")[0] for bases in _MADE_OF.values() for b in bases}


def _check_known(arrays) -> None:
    """Every name is one the mapping reads or knows to have no site (`UNMAPPED`): a misspelt or renamed capture
    (`layer_out-5` for `l_out-5`) was dropped, and the comparison passed without it."""
    bad = [key for key in arrays if parse_llamacpp_name(key)[0] not in _KNOWN]
    if bad:
        first = {}  # one example per base name ('layer_out-0' for layer_out-0..92)
        for key in bad:
            first.setdefault(parse_llamacpp_name(key)[0], key)
        hints = [f"{k!r} (did you mean {' or '.join(map(repr, m))}?)" if (m := difflib.get_close_matches(b, sorted(_KNOWN), 2))
                 else repr(k) for b, k in list(first.items())[:5]]
        raise KeyError(f"llama.cpp captures: {len(bad)} name(s) that llama.cpp's K3 graph does not give, such as "
                       f"{', '.join(hints)}{' ...' if len(first) > 5 else ''}. The names read are listed in "
                       "kimi_explore.engines.name_maps; drop "
                       "names you added, or map them yourself (compare(..., names={their name: hook name}))")


def _per_token_heads(a, T: int, key: str):
    """MLA records: decode [T, H, 1, n] -> [T, H, n]; prefill [H, T, n] -> [T, H, n]."""
    if a.ndim == 4:
        return a[:, :, 0, :]
    if a.ndim == 3 and a.shape[1] == T:
        return a.swapaxes(0, 1)
    raise ValueError(f"llama.cpp captures: {key!r} has shape {a.shape}, expected decode [T, H, 1, n] or prefill [H, T, n] "
                     f"with T={T}")


def _f32(a):
    return np.asarray(a, dtype=np.float32)

