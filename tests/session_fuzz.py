"""Differential fuzz of `Session` (run by hand; tests/test_session_fuzz.py runs a few short seeds): seeded random
operations on a pool of sessions over one tiny model, each session checked after EVERY operation against an
independent model of what it must hold.

Operations: step; feed (chunk 1, 7, 2..13 or the default, lengths not dividing it); feed / step / generate
inside `intervene` (built-in interventions, one restricted to even positions); a value-changing recorder hook
(or session hook without a recorder) switched on and off; greedy and sampled generate; truncate (to 0, the
end, chunk ends, one off a chunk end, anywhere); back; fork (then both go on; a fork whose every array is overwritten, which must change nothing of its parent); snapshot (shared or copied
arrays) and restore (also into another session of the pool); save_state / load_state (with and without
checkpoints; loaded with recorder=False, which must replay chunks fed under a full record as they were fed); state_after; a hook raising in the middle of a feed; the decoder raising after it advanced the
state (a failed chunk or step must leave no trace), or inside the replay of a truncate (which must change nothing).

What each session is checked against:
- GROUND TRUTH: a brand-new state stepping the session's current history one token at a time with
  `kimi_forward_token`, each token with a fresh Recorder of the same settings and the same hooks the
  session had on that token (cached per history prefix). Logits and records of a token are compared when
  it is first decoded; the state (KDA conv windows and recurrent matrices, MLA length and used positions),
  and the logits of a probe token stepped from a copy of the state, after every operation. float64: within
  1e-9 of each array's scale, routing ids identical; float32: within 1e-4 (the random model: 2e-2; see TOL).
- BIT-IDENTITY, where the docstrings promise it: the logits and records a session holds are, bit for bit,
  those it returned / recorded when the token was first decoded (whatever truncates, restores, forks,
  loads came since); and the decode state (and the probe logits) is a function of how the history was
  decoded: the same runs (stepped tokens with their hooks, fed chunks as fed; a chunk cut by truncate as
  its kept part) must give the same bits, whichever route (straight, truncate and replay, restore, fork,
  load, recovery after an error) led there.
- `runs()` and `cut_tail()` against the model's own record of how each token was decoded.

    python tests/session_fuzz.py random|trained float64|float32 N_OPS TMP_DIR SEED [SEED ...]

Prints one line per seed (ops, final lengths, the largest differences to the ground truth) and a summary.
"""

# ruff: noqa: E501, E701, E702 (a terse harness)
from __future__ import annotations

import copy
import hashlib
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from kimi_explore import KimiDecodeState, from_pretrained, kimi_forward_token
from kimi_explore.inspection.hooks import HookChain, Hooks
from kimi_explore.inspection.interventions import ablate_experts, force_routing, scale_kda_head
from kimi_explore.inspection.recorder import Recorder, per_token
from kimi_explore.inspection.session import Session

# the largest difference to the ground truth, relative to each array's scale: the sequence path and stepping
# round differently, amplified by the model (float64 reaches ~2e-12 on both models, ~2e4 ulps); in float32 the
# trained model reaches ~5e-6, the random one ~4e-3 (float64 x the ratio of the epsilons). A bookkeeping slip differs by order one, and where the
# routes must agree bit for bit the fuzz checks bits.
TOL = {("trained", "float64"): 1e-9, ("random", "float64"): 1e-9, ("trained", "float32"): 1e-4, ("random", "float32"): 2e-2}
IVS = {  # built-in interventions, attached with `session.intervene` for one operation
    "abl4": lambda: ablate_experts(4, "all"),
    "kda1": lambda: scale_kda_head(1, 0, 0.5),
    "force2": lambda: force_routing(2, [0, 1]),
    "abl5even": lambda: ablate_experts(5, list(range(8)), positions=range(0, 1 << 16, 2)),
}
PERM_SITE = "layers.3.attn.out"  # a value-changing hook held by the recorder (or the session) across operations


def perm_fn(value, *, hook):
    return value * 0.75


REC_CFGS = {"none": None, "default": {}, "full": {"full": ["layers.3.mla.probs", "layers.1.kda.state", "layers.5.ffn.out"], "top_k": 5},
            "filtered": {"names_filter": ["layers.[13].*", "logits", "final.*"], "full": ["layers.3.mla.*", "layers.1.kda.conv"], "top_k": 3}}



def cached_prefix(cache: dict, key: tuple) -> int:
    """The length of key's longest proper prefix that `cache` holds (0 if none): where a memoised replay resumes."""
    i = len(key) - 1
    while i > 0 and key[:i] not in cache:
        i -= 1
    return i

class Boom(Exception):
    pass


def new_recorder(cfg):
    return None if cfg is None else Recorder(**copy.deepcopy(cfg))


# ---------------------------------------------------------------- ground truth


class Truth:
    """Straight decodes of histories ((token, tag), ...), one token at a time from a brand-new state, cached."""

    def __init__(self, w, rec_cfg):
        self.w, self.rec_cfg = w, rec_cfg
        self.rows: dict = {}  # history -> (logits [V], {key: row} of its last token)
        self.states: dict = {}  # history -> state after it (bounded)

    @staticmethod
    def hooks_for(tag):
        h = Hooks()
        for name in tag:
            if name == "perm":
                h.add(PERM_SITE, perm_fn)
            elif name in IVS:
                h.extend(IVS[name]())
        return h

    def state(self, hist: tuple) -> KimiDecodeState:
        if hist in self.states:
            return self.states[hist]
        if not hist:
            return KimiDecodeState.new(self.w)
        k = cached_prefix(self.states, hist)
        st = copy.deepcopy(self.state(hist[:k]))
        for t in range(k, len(hist)):
            tok, tag = hist[t]
            rec = new_recorder(self.rec_cfg)
            if rec is not None:
                rec.bind(self.w)
            h = self.hooks_for(tag)
            parts = [x for x in (h if len(h) else None, rec) if x is not None]
            hooks = HookChain(*parts) if parts else None
            if hooks is not None:
                hooks.begin_token(tok, t)
            lg = np.array(kimi_forward_token(self.w, st, tok, hooks))
            rows = {} if rec is None else {k2: v[0] for k2, v in per_token(rec.state_dict()["blocks"]).items() if v}
            self.rows[hist[: t + 1]] = (lg, rows)
            if t == len(hist) - 1 or (t + 1) % 8 == 0:
                self.states[hist[: t + 1]] = copy.deepcopy(st)
        while len(self.states) > 600:
            self.states.pop(next(iter(self.states)))
        return self.states[hist]

    def token(self, hist: tuple):
        if hist not in self.rows:
            self.state(hist)
        return self.rows[hist]


# ---------------------------------------------------------------- the model of one session's history


class Model:
    """What a session must hold: tokens with the hooks each was decoded under, the logits and records
    first returned for each (bit for bit), the runs that decoded them, and whether checkpoints were dropped."""

    def __init__(self):
        self.toks: list[int] = []
        self.tags: list[tuple] = []
        self.logits: list = []
        self.rows: list = []  # per token {key: row}
        self.runs: list = []  # ["s", start, tag] or ["c", start, kept tokens, tokens as fed]
        self.no_ckpt = False  # loaded from a file without checkpoints

    def clone(self):
        m = Model()
        m.toks, m.tags, m.logits, m.rows = list(self.toks), list(self.tags), list(self.logits), list(self.rows)
        m.runs = [list(r) for r in self.runs]
        m.no_ckpt = self.no_ckpt
        return m

    def hist(self, n=None):
        n = len(self.toks) if n is None else n
        return tuple(zip(self.toks[:n], self.tags[:n], strict=True))

    def add_step(self, tok, tag, lg, rows):
        self.runs.append(["s", len(self.toks), tag])
        self.toks.append(tok); self.tags.append(tag); self.logits.append(lg); self.rows.append(rows)

    def add_chunk(self, ids, lgs, rows, route):
        self.runs.append(["c", len(self.toks), tuple(ids), tuple(ids), route])
        self.toks += ids; self.tags += [()] * len(ids); self.logits += list(lgs); self.rows += rows

    def runs_upto(self, n):
        """The runs decoding the first n tokens (a chunk cut at n: its kept part)."""
        out = []
        for r in self.runs:
            a = r[1]
            if a >= n:
                break
            if r[0] == "s":
                out.append(list(r))
            else:
                kept = r[2][: n - a]
                out.append(["c", a, kept, r[3], r[4]])
        return out

    def truncate(self, n):
        self.runs = self.runs_upto(n)
        del self.toks[n:], self.tags[n:], self.logits[n:], self.rows[n:]
        for t, rows in enumerate(self.rows):  # a cut chunk's mla.probs rows lose the positions past the history
            if rows and any(k.endswith("mla.probs") and v.shape[-1] > n for k, v in rows.items()):
                self.rows[t] = {k: v[..., :n] if k.endswith("mla.probs") else v for k, v in rows.items()}

    def key(self, n=None):
        """How the first n tokens were decoded: what their state's bits are a function of."""
        return tuple(("s", self.toks[r[1]], r[2]) if r[0] == "s" else ("c", r[2], r[4]) for r in self.runs_upto(len(self.toks) if n is None else n))


# ---------------------------------------------------------------- comparisons


def scale_diff(got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.size == 0:
        return 0.0
    return float(np.abs(got.astype(np.float64) - want).max() / max(1.0, float(np.abs(want).max())))


def state_bits(state) -> str:
    h = hashlib.sha256()
    h.update(str(state.position).encode())
    for ls in state.layers:
        att = ls.attention
        if att.kind == "kda":
            for a in (att.conv, att.recurrent):
                h.update(str(a.shape).encode()); h.update(np.ascontiguousarray(a).tobytes())
        else:
            h.update(str((att.length, att.keys.shape, att.values.shape)).encode())
            for a in (att.keys, att.values):
                h.update(np.ascontiguousarray(a[:, : att.length]).tobytes())
    return h.hexdigest()


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes())


class Fuzz:
    def __init__(self, w, seed, tmp, tol):
        self.w, self.rng, self.tmp = w, np.random.default_rng(seed), Path(tmp)
        self.V = w.config.vocab_size
        self.tol = tol
        r = self.rng
        self.rec_name = str(r.choice(list(REC_CFGS)))
        self.rec_cfg = REC_CFGS[self.rec_name]
        self.ce = int(r.choice([0, 1, 3, 16]))
        self.truth = Truth(w, self.rec_cfg)
        self.probe = int(r.integers(self.V))
        self.bits: dict = {}  # key of how a history was decoded -> (state bits, probe logits bits)
        self.old_traces: list = []  # (a Trace taken earlier, copies of its arrays, its tokens)
        self.replays: dict = {}  # key -> the state after a fresh replay of its runs (`replayed`)
        self.maxdiff = {"logits": 0.0, "records": 0.0, "state": 0.0, "probe": 0.0}
        self.recorded = 0  # tokens whose records were compared with the ground truth
        self.id_mismatch = 0  # float32: routing ids differing from the ground truth (near ties)
        self.counts: dict = {}
        s = Session(w, recorder=self.new_rec(), checkpoint_every=self.ce)
        self.pool = [[s, Model(), False]]  # session, model, perm hook on
        self.snaps: list = []

    def new_rec(self):
        return new_recorder(self.rec_cfg) if self.rec_cfg is not None else False

    # ------------------------------------------------------------ checks
    def note(self, what, d):
        self.maxdiff[what] = max(self.maxdiff[what], d)
        assert d <= self.tol, (what, d)

    def first_sight(self, s, m, start):
        """Tokens start.. just decoded: the session's logits and records against the ground truth; remember them."""
        rows_all = per_token(s.recorder.state_dict()["blocks"]) if s.recorder is not None else {}
        for t in range(start, len(m.toks)):
            lg_ref, rows_ref = self.truth.token(m.hist(t + 1))
            self.note("logits", scale_diff(m.logits[t], lg_ref))
            if s.recorder is None:  # a session loaded with recorder=False (the ground truth records as the others)
                m.rows[t] = {}
                continue
            rows = {k: v[t] for k, v in rows_all.items() if len(v) > t}
            assert sorted(rows) == sorted(rows_ref), ("record keys", t, set(rows) ^ set(rows_ref))
            for k, x in rows.items():
                y = rows_ref[k]
                assert x.dtype == y.dtype and x.ndim == y.ndim, ("record dtype", k, t, x.dtype, y.dtype)
                if x.shape != y.shape:  # a fed chunk's mla.probs row: [nh, L0 + T], NaN past the token (chunk_records)
                    assert k.endswith("mla.probs") and all(a >= b for a, b in zip(x.shape, y.shape, strict=True)), ("record shape", k, t, x.shape, y.shape)
                    pad = np.ones(x.shape, bool); pad[tuple(slice(0, n) for n in y.shape)] = False
                    assert np.isnan(x[pad]).all(), ("record padding", k, t)
                    x = x[tuple(slice(0, n) for n in y.shape)]
                if x.dtype.kind in "iu":
                    if k.endswith("logits.top_ids"):
                        ok = x[0] == y[0]
                    else:
                        ok = np.array_equal(x, y)
                    if not ok:
                        assert self.w.dtype != np.float64, ("routing ids differ in float64", k, t, x, y)
                        self.id_mismatch += 1
                else:
                    self.note("records", scale_diff(x, y))
            m.rows[t] = rows
            self.recorded += 1

    def check(self, s, m, what):
        T = len(m.toks)
        assert s.tokens == m.toks and len(s) == T, (what, "tokens", s.tokens, m.toks)
        if T:
            t = int(self.rng.integers(-T, T))
            assert same_bits(s.logits_at(t), m.logits[t]), (what, "logits_at", t)
        L = s.logits
        assert L.shape == (T, self.V) and L.dtype == self.w.dtype, (what, "logits shape", L.shape)
        for t in range(T):
            assert same_bits(L[t], m.logits[t]), (what, "stored logits changed", t)
        assert [tuple(r) for r in s.runs()] == [(r[1], None) if r[0] == "s" else (r[1], r[1] + len(r[2])) for r in m.runs], (what, "runs", list(s.runs()), m.runs)
        for r in m.runs:
            if r[0] == "c":
                assert s.cut_tail(r[1]) == list(r[3][len(r[2]):]), (what, "cut_tail", r[1], s.cut_tail(r[1]), r[3][len(r[2]):])
        if s.recorder is not None and self.rng.integers(3):  # not always: a Trace stacks rows lazily, between calls
            rows = per_token(s.recorder.state_dict()["blocks"])
            for k in set(rows) | {k for r in m.rows for k in r}:
                v = rows.get(k, [])
                assert len(v) == T, (what, "records", k, len(v), T)
                for t in range(T):
                    assert same_bits(v[t], m.rows[t][k]), (what, "stored record changed", k, t)
            tr = s.trace()
            if self.rng.integers(4) == 0:  # "later steps do not change it": checked after every later operation
                self.old_traces = [*self.old_traces[-3:], (tr, {k: np.array(v) for k, v in tr.items()}, list(tr.tokens))]
            refs = [self.truth.token(m.hist(t + 1))[1] for t in range(T)]
            for k in tr.keys():  # the stacked Trace has the shape a straight decode's has
                want = (T,) + tuple(max(r[k].shape[d] for r in refs) for d in range(refs[0][k].ndim)) if T else None
                assert tr[k].shape == want, (what, "trace shape", k, tr[k].shape, want)
            assert list(tr.tokens) == m.toks and list(tr.positions) == list(range(T)), (what, "trace tokens/positions")
            for k in tr.keys():
                a = tr[k]
                for t in range(T):
                    r = np.asarray(m.rows[t][k])
                    got = a[t][tuple(slice(0, n) for n in r.shape)]
                    assert same_bits(got, r), (what, "trace row", k, t)
            if T:
                a, b = sorted(int(x) for x in self.rng.integers(T + 1, size=2))
                if self.rng.integers(2):
                    a, b = a - T, (None if b == T else b - T)
                tw = s.trace(window=slice(a, b))
                a, b = slice(a, b).indices(T)[:2]
                assert list(tw.tokens) == m.toks[a:b] and all(np.array_equal(tw[k], tr[k][a:b], equal_nan=True) for k in tw.keys()), (what, "window", a, b)
        # the state: ground truth within rounding, and the bits of this way of decoding the history
        ref = self.truth.state(m.hist())
        self.cmp_state(s.state, ref, what)
        self.cmp_bits(s.state, m.key(), what)

    def cmp_state(self, st, ref, what):
        assert st.position == ref.position, (what, "position", st.position, ref.position)
        for j, (la, lb) in enumerate(zip(st.layers, ref.layers, strict=True)):
            x, y = la.attention, lb.attention
            if x.kind == "kda":
                self.note("state", scale_diff(x.conv, y.conv)); self.note("state", scale_diff(x.recurrent, y.recurrent))
            else:
                assert x.length == y.length, (what, "mla length", j, x.length, y.length)
                n = x.length
                self.note("state", scale_diff(x.keys[:, :n], y.keys[:, :n])); self.note("state", scale_diff(x.values[:, :n], y.values[:, :n]))
        p, q = st.copy(), copy.deepcopy(ref)
        self.note("probe", scale_diff(kimi_forward_token(self.w, p, self.probe), kimi_forward_token(self.w, q, self.probe)))

    def cmp_bits(self, st, key, what):
        lg = np.asarray(kimi_forward_token(self.w, st.copy(), self.probe))
        got = (state_bits(st), hashlib.sha256(lg.tobytes()).hexdigest())
        want = self.bits.setdefault(key, got)
        assert got[0] == want[0], (what, "state bits differ from an earlier decode of the same runs", key[-3:])
        assert got[1] == want[1], (what, "probe logits bits differ", key[-3:])
        assert got[0] == state_bits(self.replayed(key)), (what, "state bits differ from a fresh replay of its runs", key[-3:])

    def replayed(self, key):
        """The state after decoding `key`'s runs from a brand-new state, each as the key says: a stepped token
        with its hooks, a chunk on the sequence path (with a recorder keeping the config's full records if the
        session fed it recording them, which changes the route of mla.probs and kda.*). Cached by key prefix."""
        if key in self.replays:
            return self.replays[key]
        if not key:
            return KimiDecodeState.new(self.w)
        i = cached_prefix(self.replays, key)
        st = copy.deepcopy(self.replayed(key[:i])) if i else KimiDecodeState.new(self.w)
        for run in key[i:]:
            if run[0] == "s":
                h = self.truth.hooks_for(run[2])
                if len(h):
                    h.begin_token(run[1], st.position)
                kimi_forward_token(self.w, st, run[1], h if len(h) else None)
            else:
                rec = Recorder(names_filter=lambda name: False, full=self.rec_cfg["full"]).bind(self.w) if run[2] else None
                self.w.forward_sequence(st, list(run[1]), rec, chunk=len(run[1]))
        self.replays[key] = st
        while len(self.replays) > 400:
            self.replays.pop(next(iter(self.replays)))
        return st

    def check_all(self, what):
        for tr, arrays, toks in self.old_traces:
            assert list(tr.tokens) == toks and sorted(tr.keys()) == sorted(arrays), (what, "an earlier Trace changed")
            for k, v in arrays.items():
                assert tr[k].shape == v.shape and np.array_equal(tr[k], v, equal_nan=True), (what, "an earlier Trace changed", k)
        for i, (s, m, _) in enumerate(self.pool):
            self.check(s, m, f"{what} [session {i}]")

    # ------------------------------------------------------------ operations
    def tag_for(self, perm, iv):
        return (("perm",) if perm else ()) + ((iv,) if iv else ())

    def op(self, i):
        r = self.rng
        k = int(r.integers(len(self.pool)))
        s, m, perm = self.pool[k]
        T = len(m.toks)
        ops = ["step", "feed", "feed", "ifeed", "istep", "gen", "truncate", "truncate", "back", "fork", "snap", "restore",
               "save", "perm", "state_after", "raise", "fail", "scribble", "failtrunc"]
        op = str(r.choice(ops))
        if T > 120 and op in ("step", "feed", "ifeed", "istep", "gen", "raise", "fail"):
            op = "truncate"
        if op in ("gen", "back", "state_after") and T == 0:
            op = "feed"
        desc = [op]
        self.counts[op] = self.counts.get(op, 0) + 1
        ivname = str(r.choice(list(IVS)))
        if op in ("step", "istep"):
            iv = ivname if op == "istep" else None
            tok = int(r.integers(self.V)); desc += [tok, iv]
            with (s.intervene(IVS[iv]()) if iv else _null()):
                lg = s.step(tok)
            m.add_step(tok, self.tag_for(perm, iv), lg.copy(), None)
            assert same_bits(lg, s.logits[-1]), "step returned other logits than it stored"
            self.first_sight(s, m, T)
        elif op in ("feed", "ifeed"):
            iv = ivname if op == "ifeed" else None
            n = int(r.integers(1, 30)); chunk = [1, 7, None, int(r.integers(2, 14))][int(r.integers(4))]
            ids = r.integers(self.V, size=n).tolist(); desc += [n, chunk, iv]
            with (s.intervene(IVS[iv]()) if iv else _null()):
                out = s.feed(ids, chunk=chunk, progress=False)
            assert out.shape == (n, self.V)
            self.model_feed(s, m, ids, chunk, self.tag_for(perm, iv), out)
            self.first_sight(s, m, T)
        elif op == "gen":
            n = int(r.integers(1, 5)); temp = float(r.choice([0.0, 0.8])); seed = int(r.integers(1000))
            iv = ivname if r.integers(3) == 0 else None
            stop = set(r.integers(self.V, size=int(r.integers(0, 60))).tolist())
            desc += [n, temp, iv, len(stop)]
            prev = m.logits[-1]
            with (s.intervene(IVS[iv]()) if iv else _null()):
                got = s.generate(n, temperature=temp, seed=seed, stop_tokens=stop)
            rng2 = np.random.default_rng(seed)
            stops = [j for j, tid in enumerate(got) if tid in stop]
            assert len(got) == (stops[0] + 1 if stops else n) and len(stops) <= 1 and (not stops or stops[0] == len(got) - 1), ("generate stop", got, stops)
            for j, tid in enumerate(got):
                if temp == 0:
                    want = int(np.argmax(prev))
                else:
                    z = prev.astype(np.float64) / temp; p = np.exp(z - z.max())
                    want = int(rng2.choice(p.shape[0], p=p / p.sum()))
                assert tid == want, ("generate chose", j, tid, want)
                prev = s.logits[T + j]
                m.add_step(tid, self.tag_for(perm, iv), prev.copy(), None)
            self.first_sight(s, m, T)
        elif op in ("truncate", "back"):
            if op == "back":
                kk = int(r.integers(min(T, 9) + 1)); n = T - kk; desc.append(kk)
            else:
                ends = [rr[1] for rr in m.runs] + [T]
                cands = [0, T, int(r.integers(T + 1))] + ends + [e - 1 for e in ends if e > 0] + [e + 1 for e in ends if e < T]
                n = int(r.choice(cands)); desc.append(n)
            try:
                s.truncate(n) if op == "truncate" else s.back(kk)
            except RuntimeError as e:
                assert "cannot rebuild" in str(e) and m.no_ckpt and any(m.tags[:n]), (desc, e)
                desc.append("refused")
            else:
                m.truncate(n)
        elif op == "fork":
            if len(self.pool) < 3:
                self.pool.append([s.fork(), m.clone(), perm])
            else:
                self.pool[int(r.integers(1, 3))] = [s.fork(), m.clone(), perm]
        elif op == "failtrunc":  # the replay inside truncate raises: the session must be as before
            n = int(r.integers(T + 1)); desc.append(n)
            real = {name: getattr(self.w, name) for name in ("forward_token", "forward_sequence")}

            def failing(*a, **kw):
                raise Boom("in the replay")
            for name in real:
                setattr(self.w, name, failing)
            try:
                s.truncate(n)
                desc.append("no replay")
            except Boom:
                desc.append("failed")
            except RuntimeError as e:
                assert "cannot rebuild" in str(e) and m.no_ckpt and any(m.tags[:n]), (desc, e)
                desc.append("refused")
            else:
                m.truncate(n)
            finally:
                for name in real:
                    delattr(self.w, name)
        elif op == "scribble":  # a fork's arrays overwritten: nothing of the parent may change
            f2 = s.fork()
            arrays = list(f2.state.arrays()) + [a for c in f2._checkpoints.values() for a in c.arrays()] + list(f2._logits)
            if f2.recorder is not None:
                arrays += [a for blocks in f2.recorder.state_dict()["blocks"].values() for a in blocks]
            for a in arrays:
                a = a.base if not a.flags.writeable and a.base is not None else a
                if a.flags.writeable and a.dtype.kind in "fiub":
                    a[...] = 7 if a.dtype.kind in "iub" else np.nan
            f2.step(int(r.integers(self.V))); f2.truncate(0)
        elif op == "snap":
            ca = bool(r.integers(2)); desc.append(ca)
            self.snaps.append((s.snapshot(copy_arrays=ca), m.clone()))
            self.snaps = self.snaps[-4:]
        elif op == "restore":
            if self.snaps:
                j = int(r.integers(len(self.snaps))); desc.append(j)
                snap, ms = self.snaps[j]
                if s.recorder is not None and snap.records is None:
                    try:
                        s.restore(snap)
                        raise AssertionError("restored a snapshot without records into a recording session")
                    except ValueError:
                        desc.append("refused")
                else:
                    s.restore(snap)
                    self.pool[k][1] = ms.clone()
        elif op == "save":
            ck = bool(r.integers(2)); desc.append(ck)
            path = s.save_state(self.tmp / f"s{k}.npz", checkpoints=ck)
            rec = not (self.rec_cfg is not None and r.integers(3) == 0); desc.append(rec)  # recorder=False: another route
            s2 = Session.load_state(path, self.w, recorder=rec)
            m2 = m.clone(); m2.no_ckpt = m2.no_ckpt or not ck
            self.pool[k] = [s2, m2, False]  # hooks are not saved
        elif op == "perm":
            if perm:
                (s.recorder if s.recorder is not None else s.hooks).remove(perm_fn)
            else:
                (s.recorder if s.recorder is not None else s.hooks).add(PERM_SITE, perm_fn)
            self.pool[k][2] = not perm; desc.append(not perm)
        elif op == "state_after":
            n = int(r.integers(T + 1)); desc.append(n)
            try:
                st = s.state_after(n)
            except RuntimeError as e:
                assert "cannot rebuild" in str(e) and m.no_ckpt and any(m.tags[:n]), (desc, e)
                desc.append("refused")
            else:
                self.cmp_state(st, self.truth.state(m.hist(n)), f"state_after({n})")
                self.cmp_bits(st, m.key(n), f"state_after({n})")
        elif op == "raise":
            n = int(r.integers(2, 15)); at = T + int(r.integers(n)); layer = int(r.integers(self.w.config.num_hidden_layers))
            ids = r.integers(self.V, size=n).tolist(); on_rec = s.recorder is not None and bool(r.integers(2))
            desc += [n, at, layer, on_rec]

            def bad(value, *, hook, at=at):
                if hook.position == at:
                    raise Boom(f"boom at {at}")
            holder = s.recorder if on_rec else s.hooks
            holder.add(f"layers.{layer}.attn.out", bad)
            try:
                s.feed(ids, progress=False)
                raise AssertionError("the hook did not raise")
            except Boom:
                pass
            finally:
                holder.remove(bad)
            tag = self.tag_for(perm, None) + ("noop",)
            for j in range(at - T):
                m.add_step(ids[j], tag, s.logits[T + j].copy(), None)
            self.first_sight(s, m, T)
        elif op == "fail":
            stepping = perm or bool(r.integers(3) == 0)
            n = int(r.integers(1, 20)); chunk = [1, 7, None, int(r.integers(2, 14))][int(r.integers(4))]
            ids = r.integers(self.V, size=n).tolist()
            nruns = n if stepping else -(-n // (chunk or 10**9))
            bad_call = int(r.integers(nruns)); desc += [n, chunk, stepping, bad_call]
            name = "forward_token" if stepping else "forward_sequence"
            real = getattr(self.w, name); calls = [0]

            def failing(*a, **kw):
                out = real(*a, **kw)
                calls[0] += 1
                if calls[0] == bad_call + 1:
                    raise Boom("after advancing the state")
                return out
            setattr(self.w, name, failing)
            iv = "kda1" if stepping and not perm else None  # stepping needs a hook
            try:
                with (s.intervene(IVS[iv]()) if iv else _null()):
                    s.feed(ids, chunk=chunk, progress=False)
                raise AssertionError("did not fail")
            except Boom:
                pass
            finally:
                delattr(self.w, name)
            if stepping:
                for j in range(bad_call):
                    m.add_step(ids[j], self.tag_for(perm, iv), s.logits[T + j].copy(), None)
            else:
                c = chunk or 10**9
                for a in range(0, bad_call * c, c):
                    m.add_chunk(ids[a : a + c], [s.logits[T + a + j].copy() for j in range(len(ids[a : a + c]))], [None] * len(ids[a : a + c]), self.route(s))
            self.first_sight(s, m, T)
        return desc

    def route(self, s):
        """Whether a chunk this session feeds runs on the route a full record of mla.probs / kda.* takes."""
        return s.recorder is not None and self.rec_name in ("full", "filtered")

    def model_feed(self, s, m, ids, chunk, tag, out):
        if tag:  # hooks attached: feed steps
            for j, tok in enumerate(ids):
                m.add_step(tok, tag, out[j].copy(), None)
        else:
            c = chunk or 10**9
            for a in range(0, len(ids), c):
                m.add_chunk(ids[a : a + c], [out[a + j].copy() for j in range(len(ids[a : a + c]))], [None] * len(ids[a : a + c]), self.route(s))


class _null:
    def __enter__(self): return None
    def __exit__(self, *a): return False


def run(w, seed, nops, tmp, tol, verbose=True):
    """(ok, the Fuzz, the operations done) after `nops` operations of `seed`; tol: see TOL."""
    f = Fuzz(w, seed, tmp, tol)
    log = []
    try:
        f.check_all("start")
        for i in range(nops):
            desc = f.op(i)
            log.append(desc)
            f.check_all(f"op {i} {desc}")
    except Exception:
        if verbose:
            traceback.print_exc()
            print("LOG:", log[-12:])
        return False, f, log
    return True, f, log


def main():
    which, dtype_name, nops, tmp = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    from kimi_explore.weights.tiny_model import random_tiny_checkpoint, tiny_checkpoint
    w = from_pretrained(tiny_checkpoint() if which == "trained" else random_tiny_checkpoint(), device="cpu", dtype=dtype_name)
    Path(tmp).mkdir(parents=True, exist_ok=True)
    failed, total = [], {"logits": 0.0, "records": 0.0, "state": 0.0, "probe": 0.0}
    for seed in map(int, sys.argv[5:]):
        t0 = time.time()
        ok, f, log = run(w, seed, nops, tmp, TOL[which, dtype_name])
        for k, v in f.maxdiff.items():
            total[k] = max(total[k], v)
        print(f"seed {seed} ({which} {dtype_name}, recorder {f.rec_name}, checkpoint_every {f.ce}): "
              f"{'OK' if ok else 'FAILED at op ' + str(len(log))} {len(log)} ops, T={[len(m.toks) for _, m, _ in f.pool]}, "
              f"max diff {', '.join(f'{k} {v:.1e}' for k, v in f.maxdiff.items())}, {f.recorded} tokens' records compared, routing-id near-ties {f.id_mismatch}, "
              f"{len(f.bits)} decode keys, {time.time() - t0:.0f}s", flush=True)
        if not ok:
            failed.append(seed)
    print(f"SUMMARY {which} {dtype_name}: {len(sys.argv) - 5 - len(failed)} seeds OK, failed {failed}; max diff "
          f"{', '.join(f'{k} {v:.1e}' for k, v in total.items())}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
