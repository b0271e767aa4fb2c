"""Does the mass a block-residual softmax gives a source family measure that family's causal importance?

    res = ke.source_ablation(session)                  # or ke.source_ablation(weights, token_ids)
    res.rows                                            # one dict per (layer, site, family), see below
    res.to_pandas(); print(res.table())
    res.spearman("kl"), res.disagreements(), print(res.verdict())

For every block-residual site (layer i, before attention "attn" or before the FFN "ffn") and every
source family present there (`inspection.source_masks`: the embedding, the sealed blocks older than
the newest, the newest sealed block, the current running sum), the text is decoded once with that
family masked at that site at every token, the softmax renormalised over the other sources
(`mask_sources`), and compared with the unmasked run:

    mass        mean over tokens of sum_{j in family} p_j, the softmax mass the clean run gave it there
    loss        mean next-token loss -log p(x_{t+1}) over tokens 0..T-2, in nats, with the mask
    delta_loss  loss - the clean loss
    kl          mean over tokens t of KL(P_clean(. | x_<=t) || P_masked(. | x_<=t)), in nats

(and layer, site, family, columns: the site's own columns masked, n_sources: the sources it mixes). A family
may also be model-wide integer columns or ("block", j), as `mask_sources` takes them (`Trace.source_labels()`).

All runs go through the sequence path (`chunk` tokens per pass). A run masked at layer L starts
from the block-residual stack the clean run had before layer L (`SequenceSources.pack`), since the
layers below compute the same numbers: the rows are bit for bit those of full passes, for about
half the work. Those stacks are held for one layer at a time (the masked layers run in layer
order), so the memory is one layer's [T, sources, d], not every layer's. With the session's own
hooks (`session.hooks`, attached to the clean and masked runs alike) or a pipeline, every run is a
full `forward_sequence`. Masks are exactly those of `mask_sources`; what a row measures is checked
by hand in tests/test_source_ablation.py.
A site's "mass" is what the weights say, a row's loss and KL what the model does without that family:
a family with large mass and little effect is read but not needed (the question of arXiv 2606.13168).

On a layer subset without layer 0 (`from_pretrained(..., layers=range(4, 8))`) column 0 is not the
embedding but the input of the first loaded pushing layer (the embedding plus the outputs of the
loaded layers before it): the "embedding" family masks it all the same, and its rows and the
result's `families` name it as `Trace.source_labels()` does ("input of layer 6").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..backend import to_numpy
from ..inspection.hooks import HookChain, Hooks
from ..inspection.recorder import Recorder
from ..inspection.source_masks import SOURCE_FAMILIES, check_family, mask_sources, source_columns
from ..model.block_residual import source_labels
from ..model.kimi_decoder import token_indices
from ..model.kimi_sequence import SequenceSources, default_chunk, embed_chunk, finish_sequence, sequence_layer
from ._replay import check_replay, hooked, replay
from .logprobs import kl_divergence, log_softmax

__all__ = ["SourceAblation", "source_ablation", "spearman"]

SITES = ("attn", "ffn")


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties given their average rank."""
    x = np.asarray(x, np.float64)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tie = x == v
        if tie.sum() > 1:
            r[tie] = r[tie].mean()
    return r


def spearman(x, y) -> float:
    """Spearman's rank correlation (Pearson's r of the average ranks); NaN for fewer than 3 points or a constant."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} x values but {len(y)} y values")
    if len(x) < 3:
        return float("nan")
    rx, ry = _ranks(x) - (len(x) + 1) / 2, _ranks(y) - (len(y) + 1) / 2
    den = float(np.sqrt((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / den) if den > 0 else float("nan")


@dataclass
class SourceAblation:
    """Rows of `source_ablation` (module docstring) and the clean run's numbers."""

    rows: list[dict]
    n_tokens: int
    clean_loss: float
    families: tuple = SOURCE_FAMILIES
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def column(self, key: str, family=None) -> np.ndarray:
        return np.array([r[key] for r in self.rows if family is None or r["family"] == family])

    def to_pandas(self):
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("SourceAblation.to_pandas needs pandas: pip install pandas") from e
        return pd.DataFrame(self.rows)

    def table(self) -> str:
        n = max([13] + [len(r["family"]) for r in self.rows])  # ("input of layer 12" on a layer subset)
        head = f"{'layer':>5} {'site':<4} {'family':<{n}} {'mass':>6} {'Δloss':>8} {'KL':>8}"
        lines = [head] + [f"{r['layer']:>5} {r['site']:<4} {r['family']:<{n}} {r['mass']:>6.3f} {r['delta_loss']:>8.4f} "
                          f"{r['kl']:>8.4f}" for r in self.rows]
        return "\n".join(lines + [f"clean loss {self.clean_loss:.4f} nats over {self.n_tokens} tokens"])

    def spearman(self, effect: str = "kl", family=None) -> float:
        """Rank correlation of mass with `effect` ("kl" or "delta_loss") over the rows (of one family)."""
        return spearman(self.column("mass", family), self.column(effect, family))

    def percentiles(self, key: str) -> np.ndarray:
        """Each row's rank of `key` among all rows, scaled to 0..1 (ties: their average rank)."""
        n = len(self.rows)
        return (_ranks(self.column(key)) - 1) / (n - 1) if n > 1 else np.zeros(n)

    def disagreements(self, effect: str = "kl", gap: float = 0.5) -> list[dict]:
        """Rows whose mass and effect sit far apart in rank: |percentile(mass) - percentile(effect)| >= gap,
        largest gap first; each row gets `mass_pct`, `effect_pct` (0..1) and `gap` added."""
        if len(self.rows) < 2:
            return []
        pm, pe = self.percentiles("mass"), self.percentiles(effect)
        out = [dict(r, mass_pct=float(a), effect_pct=float(b), gap=float(a - b))
               for r, a, b in zip(self.rows, pm, pe, strict=True) if abs(a - b) >= gap]
        return sorted(out, key=lambda r: -abs(r["gap"]))

    def by_family(self, effect: str = "kl") -> dict:
        """{family: {"n", "mean_mass", "mean_effect", "spearman"}} over the rows of each family present."""
        out = {}
        for f in self.families:
            m = self.column("mass", f)
            if len(m):
                e = self.column(effect, f)
                out[f] = {"n": len(m), "mean_mass": float(m.mean()), "mean_effect": float(e.mean()),
                          "spearman": spearman(m, e)}
        return out

    def verdict(self, effect: str = "kl") -> str:
        """A few sentences computed from the rows: does mass predict importance here, and where not."""
        rho = self.spearman(effect)
        what = "KL to the clean run" if effect == "kl" else "increase of the next-token loss"
        if np.isnan(rho):
            finding = ("undefined (fewer than 3 cells, or mass or effect the same in every cell): these rows cannot say "
                       "whether mass predicts importance")
        elif rho <= -0.2:
            finding = f"{rho:.2f}: the more mass a source gets, the less masking it matters (mass ranks importance backwards)"
        else:
            strength = "strongly" if rho >= 0.7 else "moderately" if rho >= 0.4 else "weakly" if rho >= 0.2 else None
            finding = f"{rho:.2f}: " + (f"mass {strength} predicts importance" if strength else
                                        "mass does not predict importance") + " for this model"
        lines = [f"Over {len(self)} (layer, site, family) cells and {self.n_tokens} tokens, the Spearman correlation "
                 f"of softmax mass with the {what} is {finding}."]
        fam = self.by_family(effect)
        e_all = self.column(effect)
        m_all = self.column("mass")
        for f, s in fam.items():
            mass_rank = (m_all < s["mean_mass"]).mean()
            eff_rank = (e_all < s["mean_effect"]).mean()
            lines.append(f"  {f}: mean mass {s['mean_mass']:.3f}, mean {effect} {s['mean_effect']:.4f}, "
                         f"within-family Spearman {s['spearman']:.2f} over {s['n']} cells")
            if mass_rank - eff_rank >= 0.4:
                lines.append(f"    -> {f} carries more mass than its effect warrants (mass above "
                             f"{mass_rank:.0%} of cells, effect above only {eff_rank:.0%})")
            elif eff_rank - mass_rank >= 0.4:
                lines.append(f"    -> {f} matters more than its mass says (effect above {eff_rank:.0%} of cells, "
                             f"mass above only {mass_rank:.0%})")
        dis = self.disagreements(effect)
        if dis:
            worst = ", ".join(f"layer {r['layer']} {r['site']} {r['family']} (mass {r['mass']:.3f}, {effect} "
                              f"{r[effect]:.4f})" for r in dis[:4])
            which = f"{len(dis)}" if len(dis) <= 4 else f"the 4 furthest apart of {len(dis)}"
            lines.append(f"Cells where mass and effect disagree most in rank ({which} with a percentile gap >= 0.5): "
                         f"{worst}.")
        else:
            lines.append("No cell's mass and effect are more than half the ranking apart.")
        return "\n".join(lines)


def _scores(logits, ids, a: int, clean_logits):
    """(next-token losses of rows a.., KL rows to the clean run or None, the logits when clean).

    The clean run is kept as its logits, in the model's dtype, and its log-probs are taken again in
    float64 for each KL: log-probs kept in float32 would put ~1e-8 of rounding into every KL (a float64
    model's too), and make the KL of a mask that changes nothing come out nonzero, even negative."""
    host = to_numpy(logits)
    logp = log_softmax(host)
    b = a + logp.shape[0]
    nxt = ids[a + 1 : b + 1]
    loss = -logp[np.arange(len(nxt)), nxt]
    if clean_logits is None:
        return loss, None, np.array(host, copy=True)
    c = log_softmax(clean_logits[a:b])
    return loss, kl_divergence(c, logp), None


def _collect(parts):
    losses, kls, logps = zip(*parts, strict=True)
    cat = lambda xs: None if xs[0] is None else np.concatenate(xs)  # noqa: E731
    return cat(losses), cat(kls), cat(logps)


def _run(weights, ids, hooks, chunk: int, clean_logits=None):
    """(next-token losses [T-1], per-token KL to the clean run [T] or None, logits [T, V] when clean)."""
    state, parts = weights.new_state(), []
    for a in range(0, len(ids), chunk):
        b = min(a + chunk, len(ids))
        parts.append(_scores(weights.forward_sequence(state, ids[a:b], hooks, chunk=b - a), ids, a, clean_logits))
    return _collect(parts)


class _Prefixes:
    """The clean run on the sequence path, then its block-residual stacks before each masked layer, so
    that a run masked at layer L re-runs only layers L.. (the layers before it compute exactly what the
    clean run did). The stacks are held for one layer at a time: every chunk's `SequenceSources.pack`
    before layer `at`, moved on layer by layer (each layer through every chunk, with its own state) as
    `masked` asks for later layers, so that memory is one layer's stacks ([T, sources, d]; K3 at 1,024
    tokens: at most 0.26 GB), not every layer's (~14.5 GB). `masked` must be asked in layer order. Only for
    in-process weights without extra hooks; the masked run is bit for bit the full masked pass with
    the same chunks (tested)."""

    def __init__(self, weights, ids, chunk: int, record: Hooks):
        self.weights, self.ids = weights, ids
        self.clean = _run(weights, ids, record, chunk)
        self.spans = [(a, min(a + chunk, len(ids))) for a in range(0, len(ids), chunk)]
        self.packs = [embed_chunk(weights, ids[a:b]).pack() for a, b in self.spans]
        self.state, self.at = weights.new_state(), 0  # each layer's state is advanced once, when `at` passes it, then let go

    def _through(self, c: int, start: int, stop: int, state, hooks: Hooks) -> SequenceSources:
        """Chunk c's held stack through the loaded layers at positions start..stop-1."""
        w, (a, b) = self.weights, self.spans[c]
        stack = SequenceSources.unpack(self.packs[c], w.xp, w.max_sources, w.dtype, w.config.rms_norm_eps)
        hooks.begin_chunk(self.ids[a:b], range(a, b))
        for layer_w, layer_state in zip(w.layers[start:stop], state.layers[start:stop], strict=True):
            sequence_layer(layer_w, layer_state, stack, w.config, hooks)
        hooks.end_chunk()
        return stack

    def masked(self, layer: int, hooks: Hooks, clean_logits):
        w, start = self.weights, list(self.weights.layer_ids).index(layer)
        if start < self.at:
            raise RuntimeError(f"source_ablation: layer {layer} was asked for after the held stacks moved past it")
        quiet = Hooks()  # nothing listens: the same hooked route as the masked runs
        for at in range(self.at, start):
            self.packs = [self._through(c, at, at + 1, self.state, quiet).pack() for c in range(len(self.spans))]
            self.state.layers[at] = None  # passed for good (K3: an MLA layer's cache of every token)
            self.at = at + 1
        state, n, parts = w.new_state(), len(w.layers), []
        for c, (a, _) in enumerate(self.spans):
            stack = self._through(c, start, n, state, hooks)
            parts.append(_scores(finish_sequence(w.head(), stack), self.ids, a, clean_logits))
        return _collect(parts)


def source_ablation(session_or_weights, token_ids=None, families=SOURCE_FAMILIES, layers=None, sites=SITES,
                    chunk: int | None = None, progress: bool = False, reuse_prefix: bool = True) -> SourceAblation:
    """Mask each source family at each layer and site; report mass, Δloss and KL (module docstring).

    session_or_weights: a Session (its tokens, weights and `session.hooks`; its clean run is checked against the
    logits it stored, as the lens checks its replay: a history decoded under other hooks is refused), or weights
    with `token_ids` (ids, or a string: encoded by the session's tokenizer, else as UTF-8 bytes for a byte model).
    families: source families (`inspection.source_masks`; "embedding" is named "input of layer i" in the
    result on a layer subset without layer 0, see module docstring); layers: model layer ids (an int,
    or a list / range of them; default all), rows in the order given (a layer given twice: its rows twice);
    sites: "attn" and/or "ffn"; chunk: tokens per pass of the sequence path (default `default_chunk`).
    reuse_prefix: a run masked at layer L starts from the clean run's block-residual stack before L
    (the same numbers, about half the work); off, or with session hooks or a pipeline, every run
    decodes all layers through `forward_sequence`.
    """
    tokenizer, s = None, None
    if hasattr(session_or_weights, "weights") and hasattr(session_or_weights, "tokens"):
        s = session_or_weights
        weights, extra, tokenizer = s.weights, (s.hooks if len(s.hooks) else None), getattr(s, "tokenizer", None)
        ids = list(s.tokens) if token_ids is None else token_ids
    else:
        weights, extra = session_or_weights, None
        if token_ids is None:
            raise ValueError("source_ablation(weights, token_ids): give the token ids to decode (or pass a Session)")
        ids = token_ids
    if isinstance(ids, str):  # the session's tokenizer, else bytes for a byte model (a string is no other model's ids)
        if tokenizer is not None:
            ids = tokenizer.encode(ids)
        elif weights.config.vocab_size == 256:
            ids = ids.encode("utf-8")
        else:
            raise ValueError(f"source_ablation: got a string, but the model's vocabulary ({weights.config.vocab_size}) is "
                             "not bytes and there is no tokenizer: pass token ids (or a Session with a tokenizer)")
    try:
        ids = token_indices(ids, weights.config.vocab_size)
    except (TypeError, ValueError) as e:
        raise type(e)(f"source_ablation: token_ids: {e}") from None
    if len(ids) < 2:
        raise ValueError(f"source_ablation: needs at least 2 tokens (one next-token prediction), got {len(ids)}")
    if isinstance(families, str):
        raise TypeError(f"source_ablation: families must be a list of source families, got the string {families!r} "
                        f"(one family: [{families!r}])")
    for f in families:
        check_family(f)
    if isinstance(sites, str):
        raise TypeError(f"source_ablation: sites must be a list of sites among {SITES}, got the string {sites!r} "
                        f"(one site: [{sites!r}])")
    for site in sites:
        if site not in SITES:
            raise ValueError(f"source_ablation: sites must be among {SITES}, got {site!r}")
    layer_ids = list(weights.layer_ids)
    layers = layer_ids if layers is None else _layer_list(layers)
    missing = [i for i in layers if i not in layer_ids]
    if missing:
        raise ValueError(f"source_ablation: layers {missing} are not in this model (layers {layer_ids[0]}..{layer_ids[-1]})")
    chunk = default_chunk(weights.config) if chunk is None else chunk
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"source_ablation: chunk must be a positive int (tokens per pass), got {chunk!r}")
    chunk = int(chunk)
    for what, given in (("families", families), ("sites", sites), ("layers", layers)):
        if len(given) == 0:
            raise ValueError(f"source_ablation: {what} is empty: nothing to mask (leave it out for all)")
    chain = (lambda h: HookChain(extra.copy(), h)) if extra is not None else (lambda h: h)

    reuse = extra is None and hasattr(weights, "layers") and reuse_prefix
    if reuse:  # record the clean weights with a chunk hook at each mixing site
        seen: dict[str, list] = {}
        record = Hooks()
        record.add("layers.*.attn_res.*.weights",
                   lambda p, *, hook: seen.setdefault(hook.name, []).append(to_numpy(p).copy()), chunks=True)
        prefixes = _Prefixes(weights, ids, chunk, record)
        clean_losses, _, clean_logits = prefixes.clean
        weights_at = {k: np.concatenate(v) for k, v in seen.items()}
    else:
        rec = Recorder(names_filter="layers.*.attn_res.*.weights").bind(weights)
        clean_losses, _, clean_logits = _run(weights, ids, chain(rec), chunk)
        trace = rec.trace()
        weights_at = {k: trace[k] for k in trace.names()}
    if token_ids is None and s is not None:  # the session's own history: the clean run must be it (as the lens checks)
        for t in range(len(ids)):
            check_replay(clean_logits[t], s.logits_at(t), t)
        if any(hooked(s, t) for t in range(len(ids))):  # ... bit for bit where hooks changed values: only a replay
            for _ in replay(s, ()):  # of its own passes shows it (a temporary intervention moves them below any tolerance)
                pass
    clean_loss = float(clean_losses.mean())
    S = int(weights.max_sources)  # integer columns and ("block", j) count model-wide (`inspection.source_masks`)

    def masking(i: int, site: str, f):
        hooks = mask_sources(i, site, f)
        hooks.max_sources = S  # (not bound: they run beside the session's, or on the held stacks)
        return hooks

    cells = []
    for i in layers:
        for site in sites:
            name = f"layers.{i}.attn_res.{site}.weights"
            if name not in weights_at:  # layer 0's attention site mixes nothing (the stack is still empty)
                continue
            p = weights_at[name].astype(np.float64)  # [T, m]
            for f in families:
                cols = source_columns(f, p.shape[1], S, "source_ablation")
                if cols and len(cols) < p.shape[1]:
                    cells.append((i, site, f, cols, p))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(cells), unit="run", desc="source ablation")
    rows, position = [None] * len(cells), {i: k for k, i in enumerate(layer_ids)}
    first = source_labels([spec.index for spec in weights.specs if spec.is_block_boundary])[0]
    renamed = {"embedding": first} if first.startswith("input of layer") else {}  # column 0 on a layer subset
    name = lambda f: renamed.get(f, f) if isinstance(f, str) else str(f)  # noqa: E731
    for n in sorted(range(len(cells)), key=lambda n: position[cells[n][0]]):  # layer order: the held stacks only move on
        i, site, f, cols, p = cells[n]
        if reuse:
            losses, kl, _ = prefixes.masked(i, masking(i, site, f), clean_logits)
        else:
            losses, kl, _ = _run(weights, ids, chain(masking(i, site, f)), chunk, clean_logits)
        rows[n] = {"layer": i, "site": site, "family": name(f), "columns": list(cols),
                   "n_sources": int(p.shape[1]), "mass": float(p[:, cols].sum(axis=1).mean()),
                   "loss": float(losses.mean()), "delta_loss": float(losses.mean()) - clean_loss,
                   "kl": float(kl.mean())}
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return SourceAblation(rows, len(ids), clean_loss, tuple(name(f) for f in families),
                          {"chunk": chunk, "layers": layers, "sites": list(sites)})


def _layer_list(layers) -> list[int]:
    """`layers` checked: model layer ids (an int, or a list / range of them); int() would make 3.7 and "3" layer 3."""
    is_id = lambda i: isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))  # noqa: E731
    if getattr(layers, "ndim", None) == 0:  # a 0-d array: the id it holds (as every other layer argument takes it)
        layers = layers.item()
    if is_id(layers):
        return [int(layers)]
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"source_ablation: layers must be a layer id (an int) or a list of them, got {layers!r} "
                        f"({type(layers).__name__})")
    given = list(layers)
    bad = [i for i in given if not is_id(i)]
    if bad:
        raise TypeError(f"source_ablation: layers must be layer ids (ints), got {bad[0]!r} ({type(bad[0]).__name__}) "
                        f"in {given!r}")
    return [int(i) for i in given]
