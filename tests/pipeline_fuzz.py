"""Differential fuzz (run by hand, not collected): a Session over a RayPipeline against the same Session in one
process, the same seeded random operations on both (step; feed of 1-89 tokens in chunks of 1, 7, 64 or the
default; truncate to a checkpoint or anywhere; back; fork; snapshot / restore; save_state / load_state, also
across (a file from the pipeline loaded in one process and the other way round); greedy and sampled generate;
an intervention; a hook raising in the middle of a feed (session hooks and recorder hooks); ray.kill of a stage
then recover() of every pipeline session). After each operation every session pair is compared bit for bit:
tokens, logits, every recorded array, chunk/modified bookkeeping, the checkpoint set and each checkpoint's
state, the live state per layer (MLA capacity too), and the bytes held (until a stage was killed: a recovered
session's live state shares its caches with its checkpoints, one process's is a copy after a failed step).

    python tests/pipeline_fuzz.py trained|random N_OPS TMP_DIR SEED:STAGES [SEED:STAGES ...]

Starts a local Ray (num_cpus=2, no dashboard) and shuts it down. ~1 s per operation on 2 cores.
"""

# ruff: noqa: B023, E501, E701, E702 (closures are called within their iteration; a terse harness)
import gc
import re
import sys
import time
import traceback

import numpy as np
import ray
from stage_loss import kill_stage

import kimi_explore as ke
from kimi_explore.inspection.interventions import ablate_experts


def kept_first(error, one, desc: list, what: str) -> bool:
    """The pipeline session said (`error`) it now holds its first n tokens: take the one-process session back
    there too. True: it cannot go back (no checkpoint there), so the run stops."""
    n = int(re.search(r"first (\d+) tokens", str(error)).group(1))
    desc.append(f"{what} kept {n} of {len(one)}")
    try:
        one.truncate(n)
    except RuntimeError:
        print("one process cannot go back there (no checkpoint); pipeline replayed it: stop")
        return True
    return False


def cmp_state(a, b, what, full=True):
    assert a.position == b.position, (what, a.position, b.position)
    for j, (la, lb) in enumerate(zip(a.layers, b.layers, strict=True)):
        x, y = la.attention, lb.attention
        assert x.kind == y.kind
        if x.kind == "kda":
            for f in ("conv", "recurrent"):
                u, v = np.asarray(getattr(x, f)), np.asarray(getattr(y, f))
                assert u.shape == v.shape and np.array_equal(u.view(np.uint8), v.view(np.uint8)), (what, j, f)
        else:
            assert x.length == y.length, (what, j, x.length, y.length)
            assert x.keys.shape == y.keys.shape, (what, j, "capacity", x.keys.shape, y.keys.shape)
            n = x.length if not full else x.keys.shape[1]
            for f in ("keys", "values"):
                u, v = np.asarray(getattr(x, f))[:, :n], np.asarray(getattr(y, f))[:, :n]
                assert np.array_equal(u.view(np.uint8), v.view(np.uint8)), (what, j, f, n)

def cmp(one, st, pipe, what, ckpts=True):
    assert one.tokens == st.tokens, (what, "tokens", one.tokens, st.tokens)
    assert one.logits.shape == st.logits.shape, (what, "logits shape")
    assert np.array_equal(one.logits.view(np.uint8), st.logits.view(np.uint8)), (what, "logits", np.argwhere(one.logits != st.logits)[:5])
    if one.recorder is not None or st.recorder is not None:
        ta, tb = one.trace(), st.trace()
        assert sorted(ta.keys()) == sorted(tb.keys()), (what, "trace keys", set(ta.keys()) ^ set(tb.keys()))
        for k in ta.keys():
            x, y = ta[k], tb[k]
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), (what, "trace", k)
        assert ta.equals(tb), (what, "trace equals")
    cmp_state(pipe.host_state(st.state), one.state, what + " state")
    if not KILLED:  # a recovered session's live state shares its caches with its checkpoints (one process's is a copy)
        assert one._state_nbytes() == st._state_nbytes(), (what, "nbytes", one._state_nbytes(), st._state_nbytes())
    assert one._chunk_of == st._chunk_of and one._modified == st._modified, (what, "chunk_of/modified")
    assert sorted(one._checkpoints) == sorted(st._checkpoints), (what, "checkpoints", sorted(one._checkpoints), sorted(st._checkpoints))
    if ckpts:
        for t in one._checkpoints:
            cmp_state(pipe.host_state(st._checkpoints[t]), one._checkpoints[t], f"{what} ckpt{t}", full=False)

KILLED = False


class Boom(Exception):
    pass

def main(seed, stages, nops, path, tmp):
    global KILLED
    KILLED = False
    rng = np.random.default_rng(seed)
    w = ke.from_pretrained(path)
    V = w.config.vocab_size
    L = w.config.num_hidden_layers
    pipe = ke.RayPipeline(path, stages=stages)
    ce = int(rng.choice([0, 3, 16]))
    rk = int(rng.integers(3))
    def rec():
        return [True, False, ke.Recorder(full=["layers.3.mla.probs", "layers.1.kda.state", "layers.5.ffn.out"])][rk]
    one, st = ke.Session(w, checkpoint_every=ce, recorder=rec()), ke.Session(pipe, checkpoint_every=ce, recorder=rec())
    print("checkpoint_every", ce, "recorder", rk)
    pairs = [(one, st)]
    snaps = []
    log = []
    try:
        for i in range(nops):
            one, st = pairs[int(rng.integers(len(pairs)))]
            T = len(one)
            op = str(rng.choice(["step", "feed", "feed", "truncate", "back", "fork", "snap", "restore", "save", "gen",
                             "intervene", "raise", "hookfeed", "kill"], p=np.r_[np.full(13, 0.975 / 13), 0.025]))
            if op in ("truncate", "back", "gen") and T == 0:
                op = "feed"
            desc = [op]
            def both(fn):
                r1 = r2 = e1 = e2 = None
                try: r1 = fn(one)
                except Exception as e: e1 = e
                try: r2 = fn(st)
                except Exception as e: e2 = e
                assert (e1 is None) == (e2 is None), (desc, repr(e1), repr(e2))
                if e1 is not None:
                    assert isinstance(e2, type(e1)), (desc, repr(e1), repr(e2))
                    desc.append(f"raised {type(e1).__name__}")
                    return None
                if isinstance(r1, np.ndarray):
                    assert np.array_equal(r1, r2), (desc, "returned logits")
                else:
                    assert r1 == r2, (desc, r1, r2)
                return r1
            if op == "step":
                t = int(rng.integers(V)); desc.append(t)
                both(lambda s: s.step(t))
            elif op == "feed":
                n = int(rng.integers(1, 90)); chunk = [1, 7, 64, None][int(rng.integers(4))]
                ids = rng.integers(V, size=n).tolist(); desc += [n, chunk]
                both(lambda s: s.feed(ids, chunk=chunk))
            elif op == "truncate":
                # inside a fed chunk or at a checkpoint
                cands = [k for k in one._checkpoints if k <= T] + [int(rng.integers(T + 1))]
                n = int(rng.choice(cands)); desc.append(n)
                both(lambda s: s.truncate(n))
            elif op == "back":
                k = int(rng.integers(min(T, 9) + 1)); desc.append(k)
                both(lambda s: s.back(k))
            elif op == "fork":
                if len(pairs) < 3:
                    pairs.append((one.fork(), st.fork()))
                    one, st = pairs[-1]
            elif op == "snap":
                snaps.append((one.snapshot(copy_arrays=bool(rng.integers(2))), st.snapshot(copy_arrays=bool(rng.integers(2))), id(one)))
                snaps = snaps[-3:]
            elif op == "restore":
                cand = [s for s in snaps if s[2] == id(one)]
                if cand:
                    a, b, _ = cand[int(rng.integers(len(cand)))]
                    one.restore(a)
                    try:
                        st.restore(b)
                    except RuntimeError as e:  # a stale snapshot with tokens decoded under a temporary intervention
                        if kept_first(e, one, desc, "restore"):
                            return True
            elif op == "save":
                ck = bool(rng.integers(2)); desc.append(ck)
                f1 = one.save_state(f"{tmp}/one.npz", checkpoints=ck); f2 = st.save_state(f"{tmp}/st.npz", checkpoints=ck)
                cross = bool(rng.integers(2)); desc.append(cross)
                n1 = ke.Session.load_state(f2 if cross else f1, w)
                n2 = ke.Session.load_state(f1 if cross else f2, pipe)
                k = pairs.index((one, st)); pairs[k] = (n1, n2); one, st = n1, n2
            elif op == "gen":
                n = int(rng.integers(1, 6)); temp = float(rng.choice([0.0, 0.8])); seed2 = int(rng.integers(1000))
                desc += [n, temp]
                both(lambda s: s.generate(n, temperature=temp, seed=seed2))
            elif op == "intervene":
                layer = int(rng.integers(1, L)); n = int(rng.integers(1, 6)); ids = rng.integers(V, size=n).tolist()
                hooks = ablate_experts(layer, "all") if layer else None
                desc += [layer, n]
                def go(s):
                    with s.intervene(hooks):
                        return s.feed(ids, chunk=int(rng.integers(1, 8)) if False else None)
                both(go)
            elif op in ("raise", "hookfeed"):
                layer = int(rng.integers(L)); n = int(rng.integers(2, 20)); at = T + int(rng.integers(n))
                ids = rng.integers(V, size=n).tolist(); desc += [layer, n, at]
                def bad(value, *, hook, at=at):
                    if hook.position == at:
                        raise Boom(f"boom at {at}")
                site = f"layers.{layer}.attn.out"
                if op == "raise":
                    def go(s):
                        with s.hooked(site, bad):
                            return s.feed(ids)
                else:  # a recorder hook that raises: still stepping
                    def go(s):
                        h = s.recorder.add(site, bad) if s.recorder is not None else s.hooks.add(site, bad)
                        try:
                            return s.feed(ids)
                        finally:
                            h.remove()
                both(go)
            elif op == "kill":
                k = int(rng.integers(stages)); desc.append(k)
                KILLED = True
                kill_stage(pipe, k)
                for a, b in pairs:
                    try:
                        b.recover()
                    except RuntimeError as e:  # by design: tokens decoded under a temporary intervention
                        if kept_first(e, a, desc, "recover"):
                            return True
            log.append(desc)
            cmp(pairs[0][0], pairs[0][1], pipe, f"op {i} {desc}")
            for a, b in pairs[1:]:
                cmp(a, b, pipe, f"op {i} {desc} (fork)")
        print(f"seed {seed} stages {stages}: {nops} ops OK; T={[len(a) for a, _ in pairs]}; {log}", flush=True)
        return True
    except Exception:
        traceback.print_exc()
        print("LOG:", log[-10:])
        print(f"seed {seed} stages {stages}: FAILED at op {len(log)}", flush=True)
        return False
    finally:
        pairs = snaps = one = st = None
        gc.collect()
        pipe.close()

if __name__ == "__main__":
    from kimi_explore.weights.tiny_model import random_tiny_checkpoint
    which = sys.argv[1]
    path = ke.tiny_checkpoint() if which == "trained" else random_tiny_checkpoint()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for spec in sys.argv[4:]:
            seed, stages = map(int, spec.split(":"))
            t0 = time.time()
            main(seed, stages, int(sys.argv[2]), path, sys.argv[3])
            print(f"  {time.time() - t0:.0f}s", flush=True)
    finally:
        gc.collect()
        ray.shutdown()
