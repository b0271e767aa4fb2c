"""Corpus routing statistics: what each expert does over whole texts.

`routing_stats(weights, texts)` decodes every text from a fresh state on the sequence path
(`forward_sequence`, `default_chunk` tokens per pass, as `Session.feed` does) with a Recorder that
keeps the routers' top-k ids and weights (`layers.*.moe.router.topk_*`), and nothing else: no logits, no
state copies (a Session would keep [T, vocab] logits and a decode state per chunk, ~20 MiB each on the
embedded model and growing with the text; at K3 width gigabytes per document).
It accumulates, per MoE layer (M) x expert (E), over N routed tokens:

    counts[m, e]          tokens whose top-k set holds e
    weight_sum[m, e]      sum of e's combine weight over those tokens; mean_weight = weight_sum / counts
    coactivation[m, e, f] tokens whose top-k set holds both e and f (diagonal: counts)
    class_top1[m, c, e]   tokens of class c whose top-1 expert (highest score in the set) is e

Load statistics per layer, with load_e = counts[m, e] (a perfectly balanced router gives N k / E):

    max_over_mean = max_e load_e / mean_e load_e        1 when balanced, E / k when one set takes all
    cv            = std_e load_e / mean_e load_e        coefficient of variation (population std)
    dead          = {e : load_e = 0}

Mutual information between the token class C and the top-1 expert X, in bits, by the plug-in
estimate from the joint counts n(c, x) (biased upwards when counts are small):

    I(C; X) = sum_{c,x} p(c,x) log2( p(c,x) / (p(c) p(x)) ),   p = n / N

A token's class is that of the INPUT token at its position (the one whose routing it is). The
default classing, for byte models, is letters / space / digits / punctuation / newline / other;
pass `classes=` (a function token id -> label) for another one. Labels are told apart by type and
value, as a checkpoint keeps them (JSON): True, 1 and 1.0 are three classes, not one (Python's ==
would merge them); a label that is not equal to itself (NaN) is refused: it would make a class of
every token.

Workers: with `workers=n` (n > 1) the texts are decoded n at a time, each in a process forked from
this one (POSIX; host NumPy weights, which the processes share without copying), and counted here in
text order as they come back. Each worker's BLAS runs on one thread: one worker per core. The result
is one process's bit for bit where this process's BLAS runs on one thread too (OPENBLAS_NUM_THREADS=1;
with more, OpenBLAS splits a matmul differently: the counts are the same, the weight sums agree to
float32 rounding). On the embedded model n cores give about n times the tokens per second of one
(`bench/routing_stats.py`); one text gains nothing.

Checkpoints: with `checkpoint=path` the partial result is saved (atomically) after each text once
`checkpoint_every` tokens have accumulated, and at the end; calling again with the same path and
the same (or a longer) list of texts resumes after the texts already done. Texts are the unit:
split a long corpus into documents. A resume is refused for another model, other texts, or another
classing (`classes=` is asked again for every token id the checkpoint counted: a different label
would add one classing's counts to another's classes).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import multiprocessing
import string
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from ..backend import set_blas_threads
from ..inspection.npz_io import NpzReader, npz_to_read, with_npz_suffix, write_npz
from ..inspection.recorder import Recorder
from ..inspection.session_io import fingerprint_differences, weights_fingerprint
from ..model.kimi_decoder import token_indices
from ..model.kimi_sequence import default_chunk

__all__ = ["BYTE_CLASSES", "RoutingStats", "byte_class", "routing_stats"]

FORMAT = "kimi_explore.analysis.routing_stats/1"
BYTE_CLASSES = ("letter", "space", "digit", "punctuation", "newline", "other")
_PUNCT = frozenset(string.punctuation.encode())


def byte_class(token_id: int) -> str:
    """The default classing of byte ids: letter, space (space or tab), digit, punctuation, newline, other."""
    b = int(token_id)
    if 65 <= b <= 90 or 97 <= b <= 122:
        return "letter"
    if b in (32, 9):
        return "space"
    if 48 <= b <= 57:
        return "digit"
    if b in _PUNCT:
        return "punctuation"
    if b in (10, 13):
        return "newline"
    return "other"


@dataclasses.dataclass
class RoutingStats:
    """Accumulated routing over a corpus (see module docstring). Arrays are over `moe_layers` x experts."""

    moe_layers: list
    num_experts: int
    top_k: int
    class_names: list
    counts: np.ndarray  # [M, E] int64
    weight_sum: np.ndarray  # [M, E] float64
    coactivation: np.ndarray  # [M, E, E] int64
    class_top1: np.ndarray  # [M, C, E] int64
    tokens: int = 0
    texts: list = dataclasses.field(default_factory=list)  # sha1 of each text done, in order
    model: str = ""  # fingerprint of the model the counts come from
    classed: dict = dataclasses.field(default_factory=dict)  # token id -> index in class_names, each id counted so far

    @classmethod
    def empty(cls, weights, model: str) -> RoutingStats:
        from ..model.kimi_decoder import hook_names

        moe = [int(n.split(".")[1]) for n in hook_names(weights) if n.endswith(".moe.router.topk_ids")]
        M, E = len(moe), int(weights.config.num_experts)
        return cls(moe, E, int(weights.config.num_experts_per_token), [], np.zeros((M, E), np.int64), np.zeros((M, E)),
                   np.zeros((M, E, E), np.int64), np.zeros((M, 0, E), np.int64), 0, [], model)

    # ------------------------------------------------------------------ derived statistics
    @property
    def mean_weight(self) -> np.ndarray:
        """[M, E] mean combine weight of each expert over the tokens that selected it (NaN if none)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.counts > 0, self.weight_sum / np.maximum(self.counts, 1), np.nan)

    @property
    def max_over_mean(self) -> np.ndarray:
        """[M] max_e load_e / mean_e load_e (NaN before any token: no load to compare)."""
        return self._over_mean(self.counts.max(axis=1))

    @property
    def cv(self) -> np.ndarray:
        """[M] std_e load_e / mean_e load_e (NaN before any token: 0 would read as perfectly balanced)."""
        return self._over_mean(self.counts.std(axis=1))

    def _over_mean(self, x) -> np.ndarray:
        mean = self.counts.mean(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(mean > 0, x / np.maximum(mean, 1e-300), np.nan)

    @property
    def dead_experts(self) -> dict:
        """{moe layer: [expert ids never selected]}."""
        return {layer: np.flatnonzero(row == 0).tolist() for layer, row in zip(self.moe_layers, self.counts, strict=True)}

    def mutual_information(self) -> np.ndarray:
        """[M] I(class; top-1 expert) in bits (plug-in estimate)."""
        joint = self.class_top1.astype(np.float64)
        n = joint.sum(axis=(1, 2), keepdims=True)
        p = joint / np.maximum(n, 1)
        pc, px = p.sum(axis=2, keepdims=True), p.sum(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(p > 0, p * np.log2(p / (pc * px)), 0.0)
        return terms.sum(axis=(1, 2))

    def table(self) -> list[dict]:
        """One row per MoE layer: load max/mean, CV, dead experts, MI (bits)."""
        mi = self.mutual_information()
        return [{"layer": layer, "max/mean": float(self.max_over_mean[j]), "cv": float(self.cv[j]),
                 "dead": len(self.dead_experts[layer]), "mi_bits": float(mi[j])} for j, layer in enumerate(self.moe_layers)]

    def __repr__(self) -> str:
        return (f"RoutingStats({self.tokens} tokens from {len(self.texts)} texts, "
                f"{len(self.moe_layers)} MoE layers x {self.num_experts} experts)")

    # ------------------------------------------------------------------ accumulating
    def _class_index(self, label) -> int:
        key = _label_key(label)
        at = next((c for c, name in enumerate(self.class_names) if _label_key(name) == key), None)
        if at is None:
            self.class_names.append(label)
            M, _, E = self.class_top1.shape
            self.class_top1 = np.concatenate([self.class_top1, np.zeros((M, 1, E), np.int64)], axis=1)
            at = len(self.class_names) - 1
        return at

    def add(self, routing: dict, token_classes: list[str], token_ids=None) -> None:
        """Accumulate one text's `trace.routing()` ([T, M, k] ids and weights; -1 / NaN padding is skipped).
        token_ids: the text's ids, whose classes are then remembered (a resume checks its classing against them)."""
        ids, wts = routing["topk_ids"], routing["topk_weights"]
        T = ids.shape[0]
        cls = np.array([self._class_index(c) for c in token_classes], np.int64)
        if token_ids is not None:
            self.classed.update(zip(map(int, token_ids), cls.tolist(), strict=True))
        E, C = self.num_experts, len(self.class_names)
        for j in range(len(self.moe_layers)):
            sel, w = ids[:, j], wts[:, j]
            valid = sel >= 0
            picked = sel[valid]
            self.counts[j] += np.bincount(picked, minlength=E)
            self.weight_sum[j] += np.bincount(picked, weights=w[valid], minlength=E)  # this text's sums, in float64
            onehot = np.zeros((T, E))
            onehot[np.nonzero(valid)[0], picked] = 1.0
            self.coactivation[j] += np.rint(onehot.T @ onehot).astype(np.int64)  # BLAS; exact below 2**53
            has = valid[:, 0] if sel.shape[1] else np.zeros(T, bool)
            self.class_top1[j] += np.bincount(cls[has] * E + sel[has, 0], minlength=C * E).reshape(C, E)
        self.tokens += T

    # ------------------------------------------------------------------ files
    def save(self, path) -> Path:
        """Write one .npz atomically (a partial result survives an interrupted save; the suffix is added if missing,
        as `Session.save_state` and `Trace.save` add it)."""
        return self._write(with_npz_suffix(path, "RoutingStats.save"))

    def _write(self, path: Path) -> Path:
        """`save` to `path` exactly as named."""
        header = {"format": FORMAT, "moe_layers": self.moe_layers, "num_experts": self.num_experts, "top_k": self.top_k,
                  "class_names": self.class_names, "tokens": self.tokens, "texts": self.texts, "model": self.model}
        classed = np.array(sorted(self.classed.items()), np.int64).reshape(-1, 2)
        return write_npz(path, {"header": np.array(json.dumps(header)), "counts": self.counts,
                                "weight_sum": self.weight_sum, "coactivation": self.coactivation,
                                "class_top1": self.class_top1, "classed": classed}, compressed=False)

    @classmethod
    def load(cls, path) -> RoutingStats:
        """A `save`d result, checked whole: every header key, each array's shape and dtype against the header's
        layers, experts and classes (PATH.npz where `path` names no file and has no .npz suffix, as `save` named it)."""
        path = npz_to_read(path)
        with NpzReader(path, "routing-stats checkpoint") as z:
            if "header" not in z:
                raise ValueError(f"{path}: not a routing-stats checkpoint (no 'header' entry; found {z.files[:5]})")
            h = z.header(FORMAT, required=("moe_layers", "num_experts", "top_k", "class_names", "tokens", "texts", "model"))
            arrays = {k: z[k] for k in ("counts", "weight_sum", "coactivation", "class_top1")}
            classed = z["classed"] if "classed" in z else np.zeros((0, 2), np.int64)  # (older files: not kept)
        layers, E, k, names = h["moe_layers"], h["num_experts"], h["top_k"], h["class_names"]
        if not (isinstance(layers, list) and all(type(i) is int for i in layers) and type(E) is int and E > 0
                and type(k) is int and 0 < k <= E and isinstance(names, list)
                and len({json.dumps(n) for n in names}) == len(names)):  # (1 and "1" are two labels)
            raise ValueError(f"{path}: moe_layers {layers!r:.60}, num_experts {E!r}, top_k {k!r}, class_names "
                             f"{names!r:.80}: expected layer ids, experts > 0, 0 < top_k <= experts and distinct class "
                             "names (the file is damaged)")
        M, C = len(layers), len(names)
        want = {"counts": ("int64", (M, E)), "weight_sum": ("float64", (M, E)), "coactivation": ("int64", (M, E, E)),
                "class_top1": ("int64", (M, C, E))}
        for k, (dtype, shape) in want.items():
            a = arrays[k]
            if a.dtype != np.dtype(dtype) or a.shape != shape:
                raise ValueError(f"{path}: {k} is {a.dtype}{list(a.shape)}, expected {dtype}{list(shape)} (its "
                                 f"{M} MoE layers x {E} experts x {C} classes): the file is damaged")
        if classed.dtype != np.int64 or classed.ndim != 2 or classed.shape[1] != 2 or \
                (len(classed) and not (0 <= classed[:, 1].min() and classed[:, 1].max() < C)):
            raise ValueError(f"{path}: classed is {classed.dtype}{list(classed.shape)}, expected int64[n, 2] rows "
                             f"(token id, class index below {C}): the file is damaged")
        texts = h["texts"]
        if not (type(h["tokens"]) is int and h["tokens"] >= 0 and isinstance(texts, list)
                and all(isinstance(t, str) and len(t) == 40 for t in texts)):
            raise ValueError(f"{path}: tokens {h['tokens']!r:.40} and texts {texts!r:.80}: expected a count >= 0 and a "
                             "list of sha1 digests (the file is damaged)")
        return cls(h["moe_layers"], E, h["top_k"], h["class_names"], arrays["counts"], arrays["weight_sum"],
                   arrays["coactivation"], arrays["class_top1"], h["tokens"], texts, h["model"],
                   dict(zip(classed[:, 0].tolist(), classed[:, 1].tolist(), strict=True)))


def model_fingerprint(model) -> str:
    """Which model the counts come from (config, layer ids, dtype, weight samples: `weights_fingerprint`)."""
    return json.dumps(weights_fingerprint(model), sort_keys=True)


def _text_ids(j: int, text, tokenizer, vocab: int) -> list[int]:
    """Text j of the corpus as checked token ids."""
    if isinstance(text, str):
        if tokenizer is not None:
            return list(tokenizer.encode(text))
        if vocab != 256:
            raise ValueError(f"routing_stats: got a string but no tokenizer, and the model's vocabulary ({vocab}) is not "
                             "bytes: pass tokenizer=ke.load_tokenizer(...) or token ids")
        return list(text.encode("utf-8"))
    if not hasattr(text, "__len__"):
        raise TypeError(f"routing_stats: text {j} is {type(text).__name__} {text!r:.40}; expected a string or a list of "
                        "token ids (a single text of ids goes in a list: [ids])")
    try:
        return token_indices(text, vocab)
    except (TypeError, ValueError) as e:
        raise type(e)(f"routing_stats: text {j}: {e}") from None


def text_digest(ids: list[int]) -> str:
    """What `RoutingStats.texts` holds for a text of these ids."""
    return hashlib.sha1(np.asarray(ids, np.int64).tobytes()).hexdigest()


def _resume(path, weights, model: str, digests: list[str]) -> RoutingStats:
    if path is None or not Path(path).exists():
        return RoutingStats.empty(weights, model)
    stats = RoutingStats.load(path)
    try:
        saved = json.loads(stats.model)
    except ValueError:
        saved = None
    diff = fingerprint_differences(saved, json.loads(model)) if isinstance(saved, dict) else \
        [f"its fingerprint is {stats.model!r:.60}, not one this version reads"]
    if diff:
        raise ValueError(f"{path}: this routing-stats checkpoint was made with another model ({'; '.join(diff)}); "
                         "use another checkpoint path")
    done = stats.texts
    if digests[: len(done)] != done:
        first = next((i for i, (a, b) in enumerate(zip(digests, done, strict=False)) if a != b), len(digests))
        raise ValueError(f"{path}: the checkpoint holds {len(done)} texts, but text {first} of this call differs from "
                         "the one it counted (or the call has fewer texts): resume with the same texts, in the same order")
    return stats


def _check_classing(path, stats: RoutingStats, classes) -> None:
    """A resumed count classes tokens as the checkpoint did: `classes` gives each token id the checkpoint has
    counted the class it was counted in (another classing would add its counts to the first one's classes)."""
    for i, c in stats.classed.items():
        if _label_key(now := _label(classes, i)) != _label_key(stats.class_names[c]):
            raise ValueError(f"{path}: the checkpoint counted token id {i} in class {stats.class_names[c]!r}, this "
                             f"call's classes= puts it in {now!r}: resume with the classing it was made with "
                             "(or use another checkpoint path)")


def routing_stats(weights, texts, *, tokenizer=None, classes=None, progress: bool = True, checkpoint=None,
                  checkpoint_every: int = 4096, workers: int = 1) -> RoutingStats:
    """Routing statistics of `weights` over `texts` (a string, or a list of strings / token-id lists).

    classes: token id -> label, a str, int, float, bool or None (default: `byte_class` for a byte
    vocabulary); labels of other types are other classes (True, 1 and 1.0: three), NaN is refused
    (module docstring). progress: a tqdm bar over tokens. checkpoint: a path to save the partial result to
    and resume from (`.npz` added if missing). workers: texts decoded at once, each in a forked process (see module
    docstring); 1 decodes here.
    """
    vocab = int(weights.config.vocab_size)
    if classes is None:
        if vocab != 256:
            raise ValueError(f"routing_stats: the default token classing is for byte models (vocabulary 256); this one has "
                             f"{vocab} tokens: pass classes=fn(token_id) -> label")
        classes = byte_class
    if not callable(classes):
        raise TypeError(f"routing_stats: classes must be a function token id -> class label (e.g. a dict's .get), got "
                        f"{type(classes).__name__}")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, (int, np.integer)) or checkpoint_every < 1:
        raise ValueError(f"routing_stats: checkpoint_every must be a positive int (tokens between saves), got "
                         f"{checkpoint_every!r}")
    if not any(weights.config.is_moe_layer(int(i)) for i in weights.layer_ids):
        raise ValueError(f"routing_stats: none of the loaded layers {list(weights.layer_ids)} is a MoE layer (dense: "
                         f"first_k_dense_replace={weights.config.first_k_dense_replace}, moe_layer_freq="
                         f"{weights.config.moe_layer_freq}): there is no routing to count")
    if isinstance(texts, (bytes, bytearray)) or not hasattr(texts, "__iter__"):
        raise TypeError(f"routing_stats: texts must be a string or a list of texts (strings or token-id lists), got "
                        f"{type(texts).__name__}")
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise ValueError("routing_stats: texts is empty: give at least one text (a string or a list of token ids)")
    _check_workers(workers, weights)
    if tokenizer is not None and getattr(tokenizer, "vocab_size", vocab) != vocab:  # its ids would be another model's
        raise ValueError(f"routing_stats: the tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary {vocab} "
                         "(vocab_size in its config): they belong to different models")
    ids = [_text_ids(j, x, tokenizer, vocab) for j, x in enumerate(texts)]
    digests = [text_digest(x) for x in ids]
    if checkpoint is not None:
        # what `save` writes, and so what a resume reads; a file already there under the name given (one saved before
        # the suffix was added) is resumed and written as it is named
        checkpoint = Path(checkpoint) if Path(checkpoint).is_file() else with_npz_suffix(checkpoint, "routing_stats: checkpoint")
    stats = _resume(checkpoint, weights, model_fingerprint(weights), digests)
    start, since_save = len(stats.texts), 0
    _check_classing(checkpoint, stats, classes)  # (also when it holds every text: its result is this call's)
    routings = _routings(weights, ids[start:], workers, start)
    next(routings)  # the workers start (fork) now, before a progress bar's monitor thread does (see `_routings`)
    labels: dict = {}  # token id -> its class label, checked once
    bar = None
    try:
        bar = _progress(progress, sum(len(x) for x in ids), sum(len(x) for x in ids[:start]))
        for text_ids, digest, routing in zip(ids[start:], digests[start:], routings, strict=True):
            if text_ids:
                stats.add(routing, [labels[i] if i in labels else labels.setdefault(i, _label(classes, i))
                                    for i in text_ids], text_ids)
            stats.texts.append(digest)
            since_save += len(text_ids)
            if bar is not None:
                bar.update(len(text_ids))
            if checkpoint is not None and since_save >= checkpoint_every:
                stats._write(checkpoint)
                since_save = 0
    finally:
        routings.close()  # (stops the workers now, also when counting failed)
        if bar is not None:
            bar.close()
    if checkpoint is not None:
        stats._write(checkpoint)
    return stats


def _label(classes, token_id: int):
    """classes(token_id) as a label that a checkpoint keeps as it is (JSON): a str, int, float, bool or None (NumPy
    scalars as the Python ones, an enum or other subclass of str, int or float as its base value). A tuple came back
    from a checkpoint as a list, another class than the tuple of the next call: a resumed run split every class in
    two."""
    label = classes(token_id)
    if isinstance(label, np.generic):
        label = label.item()
    for base in (bool, int, float, str):  # a subclass (an IntEnum, a StrEnum) as its base, which JSON keeps
        if isinstance(label, base):
            if type(label) is not base:
                label = str.__str__(label) if base is str else base(label)
            break
    if label is not None and not isinstance(label, (str, int, float, bool)):
        raise TypeError(f"routing_stats: classes({token_id}) returned {label!r} ({type(label).__name__}); a class label "
                        "must be a str, int, float, bool or None (it is saved as JSON in a checkpoint): e.g. str(label)")
    if label != label:  # NaN: no label would ever equal it, and each token would get a class of its own
        raise ValueError(f"routing_stats: classes({token_id}) returned {label!r}, a label not equal to itself: a class "
                         "label must equal itself to gather tokens (give e.g. None or 'nan' for tokens without a class)")
    return label


def _label_key(label) -> tuple:
    """What tells two class labels apart: type and value, as their JSON in a checkpoint does (1 == True == 1.0 in
    Python, but a checkpoint keeps 1, true and 1.0, and a resumed run must find the class it counted in)."""
    return type(label), label


def _router_recorder(weights) -> Recorder:
    """The Recorder `_routing` decodes with: the routers' top-k ids and weights (what `RoutingStats.add` counts).
    One per call (or worker), its records taken after each text: its functions per site are built once."""
    return Recorder(names_filter="layers.*.moe.router.topk_*").bind(weights)


def _routing(weights, ids: list[int], recorder: Recorder) -> dict:
    """One text's `Trace.routing()`, decoded from a fresh state one chunk at a time (each chunk's logits dropped);
    `recorder` (`_router_recorder`) is left empty."""
    state, chunk = weights.new_state(), default_chunk(weights.config)
    try:
        for a in range(0, len(ids), chunk):
            weights.forward_sequence(state, ids[a : a + chunk], recorder, chunk=chunk)
        return recorder.trace().routing()
    finally:
        recorder.take_blocks()


def _check_workers(workers, weights) -> None:
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"routing_stats: workers must be a whole number >= 1 (texts decoded at once), got {workers!r}")
    if workers == 1:
        return
    if getattr(weights, "workspace", None) is None or getattr(weights, "device", None) != "cpu":
        where = ("a RayPipeline decodes in its own stages" if hasattr(weights, "close") else
                 f"these weights are on the {getattr(weights, 'device', type(weights).__name__)}, and a forked process "
                 "cannot reach a device")
        raise ValueError(f"routing_stats: workers={workers} needs host weights (device='cpu'): {where}; use workers=1")
    if "fork" not in multiprocessing.get_all_start_methods():
        raise ValueError(f"routing_stats: workers={workers} forks processes that share the weights, and this platform "
                         "cannot fork (Windows); use workers=1")


def _routings(weights, texts: list[list[int]], workers: int, first: int = 0):
    """Each text's `_routing` (None for an empty text), in order: decoded here, or by `workers` forked processes
    at most two texts each ahead of the one being counted (a long corpus is never held whole in results).
    texts[0] is text `first` of the call (after those a checkpoint holds).

    It first yields None once the workers are running: the caller starts its threads (tqdm's monitor) after
    that. A process forked while another thread holds a lock (the allocator's, I/O's) can deadlock in it, and
    Python 3.12+ warns of every fork of a multi-threaded process."""
    busy = [ids for ids in texts if ids]
    if min(workers, len(busy)) <= 1:
        yield None
        recorder = _router_recorder(weights)
        for j, ids in enumerate(texts, first):
            try:
                routing = _routing(weights, ids, recorder) if ids else None
            except Exception as e:
                _note_text(e, j)
                raise
            yield routing
        return
    pool = ProcessPoolExecutor(min(workers, len(busy)), mp_context=multiprocessing.get_context("fork"),
                               initializer=_start_worker, initargs=(weights,))  # fork: weights are shared, not sent
    queue, ahead, failed = iter(enumerate(texts, first)), collections.deque(), True
    try:
        running = 0  # (the pool forks all its workers at the first text it is given)
        while running < 2 * workers and _submit(pool, queue, ahead):
            running += ahead[-1][1] is not None
        yield None
        while ahead:
            j, future = ahead.popleft()
            try:
                routing = None if future is None else future.result()
            except BrokenProcessPool as e:
                raise RuntimeError(f"routing_stats: a worker process ended abruptly while decoding text {j} (killed, "
                                   "out of memory?); nothing of that text was counted") from e
            except Exception as e:  # the worker's own, with its traceback
                _note_text(e, j)
                raise
            _submit(pool, queue, ahead)
            yield routing
        failed = False
    finally:  # (also when the caller stops early: what is queued is dropped, the running texts are stopped)
        if failed:  # stop the workers rather than leave the pool shutting down in threads: from Python 3.12 its
            # manager thread holds the pool's lock while it joins them, and a call forking meanwhile copies that
            # lock held (its workers then deadlock when they collect the old pool)
            for process in dict(getattr(pool, "_processes", None) or {}).values():
                process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)


def _note_text(e: Exception, j: int) -> None:
    """Say which text an error came from: under its traceback (`add_note`, Python 3.11+), or on 3.10, which has no
    notes, at the end of its message (its first argument, where that is a string; the exception's type is kept)."""
    text = f"routing_stats: while decoding text {j} of the call"
    note = getattr(e, "add_note", None)
    if note is not None:
        note(text)
    elif e.args and isinstance(e.args[0], str):
        e.args = (f"{e.args[0]} ({text})", *e.args[1:])


def _submit(pool, queue, ahead) -> bool:
    """Queue the next text (an empty one needs no worker); False when no text is left."""
    item = next(queue, None)
    if item is None:
        return False
    j, ids = item
    try:
        future = pool.submit(_worker_routing, ids) if ids else None
    except BrokenProcessPool:  # a worker died meanwhile: a text queued before raises it, naming itself
        if all(f is None for _, f in ahead):
            raise
        return False
    ahead.append((j, future))
    return True


_WORKER: dict = {}  # in a worker process: the weights it decodes with, and its recorder


def _start_worker(weights) -> None:
    """A forked worker: one BLAS thread and one host thread (the workers are the parallelism)."""
    set_blas_threads(1)
    weights.workspace.threads = 1
    _WORKER["weights"], _WORKER["recorder"] = weights, _router_recorder(weights)


def _worker_routing(ids: list[int]) -> dict:
    return _routing(_WORKER["weights"], ids, _WORKER["recorder"])


def _progress(enabled: bool, total: int, done: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm  # a dependency of huggingface-hub

    return tqdm(total=total, initial=done, unit="tok", desc="routing_stats")
