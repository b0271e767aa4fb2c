"""What training put inside a byte-level tiny K3: the measures behind the shipped model's card and
notebook 05, all decoded by `kimi_forward_token` itself.

    data = pydoc_corpus(); train, val = split_corpus(data)   # the training corpus and its held-out 5%
    bits_per_byte(weights, val, window=256)                  # next-byte cross-entropy, windows from a fresh state
    attn_res_reads(weights, text)                            # mean attention-residual weight per layer, site, source
    kda_state_norms(weights, text)                           # ||S_h||_F per KDA layer, head and position
    kda_decay_rates(weights, text)                           # mean decay alpha per KDA layer and head, and its half-life
    random_twin(weights, path)                               # a random-weight checkpoint of the same shape
    inside = look_inside(weights, text)                      # all of the above plus routing, in ONE decode

Corpus: the values of `pydoc_data.topics.topics` joined in sorted key order, as UTF-8 (PSF licence), as
Python 3.11.7 ships it: the text the model was trained on, shipped beside it (`CORPUS`), since every Python
release has its own topics (3.10's differ in half the validation split's first 256 bytes), and the card's
figures hold on this text only. The last 5% of the bytes is the validation split.

Bits per byte: the text is cut into consecutive windows of `window` bytes (plus the next byte as the
last target); each window is decoded from a fresh state, and the mean of -log2 p(next byte) over
every predicted byte is returned. The trainer measures the same windows the same way.

Each function drives the decoder with a small recorder object (anything with `fire(name, value)`
is a valid `hooks=`), so a long text costs one decode and no stored trace.
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np

__all__ = ["Inside", "look_inside", "attn_res_reads", "bits_per_byte", "kda_decay_rates", "kda_state_norms", "pydoc_corpus",
           "random_twin",
           "source_labels", "split_corpus", "windows"]

VAL_FRACTION = 0.05
CORPUS_PYTHON = "3.11.7"  # the CPython whose pydoc_data.topics CORPUS holds, written there as the gzip (mtime 0) of
CORPUS = Path(__file__).resolve().parent.parent / "data" / "tiny_k3_pydoc" / "corpus.txt.gz"  # "".join(topics[k] for k
# in sorted(topics)).encode("utf-8")


def pydoc_corpus() -> bytes:
    """The training corpus (`CORPUS`): Python 3.11.7's `pydoc_data.topics.topics` values in sorted key order, UTF-8,
    466,117 bytes, the same on every Python (the model card gives its sha256)."""
    return gzip.decompress(CORPUS.read_bytes())


def split_corpus(data: bytes, val_fraction: float = VAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) uint8 arrays: the last `val_fraction` of the bytes is validation."""
    a = np.frombuffer(data, np.uint8)
    n_val = int(round(len(a) * val_fraction))
    return a[: len(a) - n_val], a[len(a) - n_val :]


def windows(a, window: int) -> np.ndarray:
    """Consecutive non-overlapping windows of window+1 ids (inputs [:window], targets [1:]): [n, window+1]."""
    a = np.asarray(a)
    n = (len(a) - 1) // window
    return np.stack([a[i * window : i * window + window + 1] for i in range(n)]) if n else np.zeros((0, window + 1), a.dtype)


def _ids(text) -> list[int]:
    if isinstance(text, str):
        return list(text.encode("utf-8"))
    return [int(t) for t in (text.tolist() if isinstance(text, np.ndarray) else text)]


def _log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    m = x.max()
    return x - (m + math.log(np.exp(x - m).sum()))


def bits_per_byte(weights, data, window: int = 256, max_windows: int | None = None) -> float:
    """Mean -log2 p(next byte) over the windows of `data` (bytes, str or ids), each from a fresh state."""
    from ..backend import to_numpy
    from ..model.kimi_decoder import KimiDecodeState, kimi_forward_token

    w = windows(np.asarray(_ids(data)), window)
    if max_windows is not None:
        w = w[:max_windows]
    if len(w) == 0:
        raise ValueError(f"bits_per_byte: the text is shorter than one window ({window + 1} ids)")
    total, count = 0.0, 0
    for row in w:
        state = KimiDecodeState.new(weights)
        for t in range(window):
            lp = _log_softmax(to_numpy(kimi_forward_token(weights, state, int(row[t]))))
            total -= lp[int(row[t + 1])]
            count += 1
    return total / count / math.log(2.0)


class _Probe:
    """A minimal hooks object: calls `take(name, value)` for the names it listens to, changes nothing."""

    def __init__(self, wanted, take):
        self.wanted, self.take = wanted, take

    def fire(self, name, value):
        if self.wanted(name):
            self.take(name, value)
        return value


def _decode(weights, ids, probe) -> None:
    from ..model.kimi_decoder import KimiDecodeState, kimi_forward_token

    state = KimiDecodeState.new(weights)
    for t in ids:
        kimi_forward_token(weights, state, int(t), hooks=probe)


def source_labels(n_sources: int) -> list[str]:
    """Names of the attention-residual sources: the sealed blocks (block 0 is the embedding), then the current sum."""
    return ["embedding" if i == 0 else f"block {i}" for i in range(n_sources - 1)] + ["current"]


def attn_res_reads(weights, text) -> dict:
    """Mean softmax weight of every attention-residual site over the positions of `text`.

    Returns {"attn": {layer: [n_sources]}, "ffn": {layer: [n_sources]}, "final": [n_sources]}; the last
    entry of each vector is the current running sum, the others the sealed blocks in push order.
    """
    from ..backend import to_numpy

    sums: dict = {}
    count = [0]

    def take(name, p):
        sums[name] = sums.get(name, 0.0) + np.asarray(to_numpy(p), np.float64)
        if name == "final.attn_res.weights":
            count[0] += 1

    _decode(weights, _ids(text), _Probe(lambda n: n.endswith(".weights") and "attn_res" in n, take))
    n = max(count[0], 1)
    out: dict = {"attn": {}, "ffn": {}, "final": sums.get("final.attn_res.weights", np.zeros(0)) / n}
    for name, s in sums.items():
        if name.startswith("layers."):
            layer, site = int(name.split(".")[1]), name.split(".")[3]
            out[site][layer] = s / n
    return out


def kda_state_norms(weights, text) -> dict:
    """{KDA layer: [T, H]} Frobenius norm of each head's recurrent state S_h after every position."""
    from ..backend import to_numpy

    rows: dict = {}

    def take(name, S):
        rows.setdefault(int(name.split(".")[1]), []).append(np.sqrt((np.asarray(to_numpy(S), np.float64) ** 2).sum(axis=(1, 2))))

    _decode(weights, _ids(text), _Probe(lambda n: n.endswith(".kda.state"), take))
    return {layer: np.stack(r) for layer, r in sorted(rows.items())}


def kda_decay_rates(weights, text) -> dict:
    """Per KDA layer: the decay alpha = exp(g) each head applies to its state, over the positions of `text`.

    Returns {layer: {"mean_alpha": [H], "half_life": [H], "max_half_life": [H], "channel_half_life": [H, K],
    "mean_alpha_channels": [H, K]}}. A key channel's half-life is ln(1/2) / (mean over positions of
    ln alpha), in bytes: how many steps that row of the state takes to forget half of what it held;
    `half_life` is each head's median channel, `max_half_life` its longest-memory channel.
    """
    from ..backend import to_numpy

    logs: dict = {}

    def take(name, alpha):
        logs.setdefault(int(name.split(".")[1]), []).append(np.log(np.asarray(to_numpy(alpha), np.float64)))

    _decode(weights, _ids(text), _Probe(lambda n: n.endswith(".kda.decay"), take))
    return _decay_summary({k: np.stack(v) for k, v in logs.items()})


def random_twin(weights, path, seed: int = 0):
    """Write a random-weight checkpoint with the same config as `weights` to `path`; returns the path.

    The baseline for "what training put inside": the same shapes and code paths, weights from the
    deterministic generator of `kimi_explore.weights.tiny_model`.
    """
    import json
    from pathlib import Path

    from ..weights.tiny_model import write_checkpoint

    src = Path(str(weights.source)) / "config.json"
    if not src.is_file():
        raise ValueError(f"random_twin: the weights come from {weights.source}, which has no config.json to copy (a "
                         "checkpoint directory has one)")
    raw = json.loads(src.read_text())
    text_config = dict(raw.get("text_config", raw))  # the kimi_k3 shell, or a bare kimi_linear config
    text_config.pop("quantization_config", None)
    return write_checkpoint(path, text_config, seed=seed)


class Inside:
    """What one decode of a text shows (see `look_inside`).

    ids:         [T] the text's ids
    reads:       {"attn": {layer: [n]}, "ffn": {layer: [n]}, "final": [n]} mean attention-residual weights
    state_norms: {KDA layer: [T, H]} ||S_h||_F after every position
    log_decay:   {KDA layer: [T, H, K]} ln alpha applied at every position
    routing:     `RoutingStats` of the text (load, MI between byte class and top-1 expert)
    """

    def __init__(self, ids, reads, state_norms, log_decay, routing):
        self.ids, self.reads, self.state_norms, self.log_decay, self.routing = ids, reads, state_norms, log_decay, routing

    def decay_rates(self) -> dict:
        """See `kda_decay_rates`: per KDA layer, per-head median / longest channel half-life (bytes) and more."""
        return _decay_summary(self.log_decay)

    def mutual_information(self) -> dict:
        """{MoE layer: I(byte class; top-1 expert) in bits}."""
        return dict(zip(self.routing.moe_layers, self.routing.mutual_information().tolist(), strict=True))

    def __repr__(self) -> str:
        return (f"Inside({len(self.ids)} tokens: {len(self.reads['attn'])} attention-residual sites, "
                f"{len(self.state_norms)} KDA layers, {len(self.routing.moe_layers)} MoE layers)")


def _decay_summary(log_decay: dict) -> dict:
    """Per layer: channel half-lives ln(1/2) / mean_t ln(alpha) [H, K], summarised per head by the median
    and the longest channel (the mean of ln alpha over channels would be dominated by the fastest ones)."""
    out = {}
    for layer, g in sorted(log_decay.items()):
        mean_g = np.minimum(g.mean(axis=0), -1e-300)  # [H, K]
        channel_half = math.log(0.5) / mean_g
        out[layer] = {"mean_alpha": np.exp(g).mean(axis=(0, 2)), "half_life": np.median(channel_half, axis=1),
                      "max_half_life": channel_half.max(axis=1), "channel_half_life": channel_half,
                      "mean_alpha_channels": np.exp(g).mean(axis=0)}
    return out


def look_inside(weights, text, classes=None) -> Inside:
    """Decode `text` once from a fresh state and collect every measure of this module, plus its routing.

    classes: token id -> label for the routing MI (default: `routing_stats.byte_class`).
    """
    from ..backend import to_numpy
    from .routing_stats import RoutingStats, byte_class, model_fingerprint, text_digest

    ids = _ids(text)
    sums: dict = {}
    norms: dict = {}
    logs: dict = {}
    topk: dict = {}
    wts: dict = {}

    def take(name, v):
        v = to_numpy(v)
        if "attn_res" in name:
            sums[name] = sums.get(name, 0.0) + np.asarray(v, np.float64)
        elif name.endswith(".kda.state"):
            norms.setdefault(int(name.split(".")[1]), []).append(np.sqrt((np.asarray(v, np.float64) ** 2).sum(axis=(1, 2))))
        elif name.endswith(".kda.decay"):
            logs.setdefault(int(name.split(".")[1]), []).append(np.log(np.asarray(v, np.float64)))
        elif name.endswith(".moe.router.topk_ids"):
            topk.setdefault(int(name.split(".")[1]), []).append(np.asarray(v, np.int64).copy())
        elif name.endswith(".moe.router.topk_weights"):
            wts.setdefault(int(name.split(".")[1]), []).append(np.asarray(v, np.float64).copy())

    suffixes = (".kda.state", ".kda.decay", ".moe.router.topk_ids", ".moe.router.topk_weights")
    wanted = (lambda n: (n.endswith(".weights") and "attn_res" in n) or n.endswith(suffixes))
    _decode(weights, ids, _Probe(wanted, take))
    T = max(len(ids), 1)
    reads: dict = {"attn": {}, "ffn": {}, "final": sums.get("final.attn_res.weights", np.zeros(0)) / T}
    for name, s in sums.items():
        if name.startswith("layers."):
            reads[name.split(".")[3]][int(name.split(".")[1])] = s / T
    stats = RoutingStats.empty(weights, model_fingerprint(weights))
    if topk:
        layers = sorted(topk)
        routing = {"topk_ids": np.stack([np.stack(topk[m]) for m in layers], axis=1),
                   "topk_weights": np.stack([np.stack(wts[m]) for m in layers], axis=1)}
        stats.add(routing, [(classes or byte_class)(i) for i in ids])
        stats.texts.append(text_digest(list(ids)))  # (one text: `routing_stats` counts it so)
    return Inside(np.asarray(ids), reads, {k: np.stack(v) for k, v in sorted(norms.items())},
                  {k: np.stack(v) for k, v in sorted(logs.items())}, stats)
