"""A llama.cpp GGUF (`kimi-k3`, split or not) as a `TensorSource`: kimi_explore runs the weights the other engine ran.

    weights = ke.from_pretrained("model.gguf")                 # or "model-00001-of-00003.gguf"

Names: each `checkpoint_table` row names its GGUF tensor (`Row.gguf`, after `blk.{i}.` for a layer's
tensors). The values are the released tensor's in ggml's reversed axis order (ne fastest first),
so the NumPy shape of a GGUF tensor is the released shape: q_proj [P, d] is `attn_q.weight` with
ne [d, P]. Where llama.cpp's converter changed a tensor, this source undoes it:

    attn-res          `attn_res_score` / `ffn_res_score` / `output_res_score` [d] ARE the score vectors
                      the decoder uses (norm gain x [1, d] projection, the product taken in float32,
                      exact for bf16 factors): `score` returns them (no norm or projection is stored)
    ssm_a [H]         = -exp(A_log[:H]) rounded to float32 by the converter. `kda_decay` recovers
                      A_log = f32(log(-ssm_a)) and returns exp(A_log) in float64, as the safetensors
                      path computes A (float64 exp, then cast). On the engine sets this gives A
                      bit-identical to the released checkpoint's on all 108 heads; -ssm_a itself
                      (what llama.cpp multiplies by) is 1 ulp off on one head of set `e`. Trap: the
                      recovered A_log can be 1 float32 ulp off (one head of set `e`; 5-9 of 16 heads
                      of random A_log in [-1, 1.5]); rounded to float32 A is the same, so float32 runs
                      are bit-identical, but with dtype="float64" those heads' A differ (logits by
                      2e-8 on set `e`, up to ~1e-5 on random models); the GGUF does not hold A_log
    attn_k_b          [nh, kl, dn]: the key half of kv_b_proj, TRANSPOSED per head; attn_v_b
                      [nh, dv, kl] the value half: kv_b_proj [nh (dn + dv), kl] is reassembled
    ssm_conv1d_{q,k,v}  ne [W, 1, P, 1]: the released [P, 1, W] values, reshaped
    ssm_g / attn_gate   the KDA / MLA `g_proj` (one released name, two GGUF names by layer kind)
    ffn_{gate,up,down}_exps   the routed experts stacked [E, rows, cols]: MXFP4 in ggml's block
                      layout (`ggml_experts.GgmlExperts`, read in place, mapped or copied) or any
                      float/quantised type (dequantised up front, experts="dense")

Types: F32, F16, BF16 (kept as bf16 bits with weight_dtype="bfloat16"), F64, Q8_0 and MXFP4 are read
here; others through the `gguf` package (`ggml_quants`). The config comes from the metadata
(`gguf_config`). Split GGUFs (`<name>-00001-of-000NN.gguf`, llama.cpp's `split.no` / `split.count` /
`split.tensors.count` keys, metadata in the first split) load as one file; a missing split is named.
`check` verifies every tensor the requested layers need (present, readable type, shape) before
anything is read, listing what is wrong.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, listed
from ..model.latent_moe import DenseExperts
from . import checkpoint_table as table
from . import ggml_quants
from .checkpoint import check_finite
from .ggml_experts import GgmlExperts
from .gguf_config import config_from_gguf
from .gguf_io import GgufFile
from .mapped_file import closed_on_error
from .tensor_reader import TensorReader
from .tensor_source import TensorSource

SPLIT = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
NATIVE = ggml_quants.FLOATS + ("Q8_0", "MXFP4")  # read without the gguf package
INTEGER = ("I8", "I16", "I32", "I64")  # ggml's integer types: never a weight (as values they would be another model)
FUSED_SCORE = ("attn_res_norm", "attn_res_proj", "mlp_res_norm", "mlp_res_proj", "output_res_norm", "output_res_proj")


def is_gguf(path) -> bool:
    """Whether `path` names a GGUF file (by its suffix, or by its magic for an existing file)."""
    p = Path(str(path))
    if p.is_dir():  # a checkpoint directory, whatever its name ends with
        return False
    if p.suffix == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def open_splits(path: str | Path) -> list[GgufFile]:
    """The GGUF at `path`, or all splits of a split GGUF (any split may be named), in split order."""
    path = Path(path)
    m = SPLIT.match(path.name)
    if m is None:
        f = GgufFile(path)
        with closed_on_error(f):
            if f.metadata.get("split.count", 1) > 1:
                raise CheckpointError(f"{path}: split {f.metadata.get('split.no', 0) + 1} of {f.metadata['split.count']}, "
                                      "but its name is not '<name>-0000N-of-0000M.gguf', so the other splits cannot be "
                                      "found")
        return [f]
    count = int(m["count"])
    names = [path.with_name(f"{m['prefix']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [str(p.name) for p in names if not p.exists()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF of {count} file(s); missing: {', '.join(missing)} (in {path.parent})")
    files = []
    with closed_on_error(files):  # (a refusal closes the files opened: each holds its file open until `close`)
        for p in names:
            files.append(GgufFile(p))
        _check_splits(files, count)
    return files


def _check_splits(files: list[GgufFile], count: int) -> None:
    for k, f in enumerate(files):
        no, n = f.metadata.get("split.no"), f.metadata.get("split.count")
        if no != k or n != count:
            raise CheckpointError(f"{f.path}: expected split.no = {k} and split.count = {count} (from its name), "
                                  f"found {no!r} and {n!r}")
    total, want = sum(len(f.tensors) for f in files), files[0].metadata.get("split.tensors.count")
    if want is not None and total != want:
        raise CheckpointError(f"{files[0].path}: split.tensors.count = {want}, but the {count} splits hold {total} tensors")


def _squeezed(shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape if d != 1)


class GgufSource(TensorSource):
    """The tensors of a `kimi-k3` GGUF under their released names (see the module docstring)."""

    def __init__(self, path: str | Path):
        self.files = open_splits(path)
        with closed_on_error(self):
            self._read(path)

    def _read(self, path) -> None:
        self.path = self.files[0].path
        self.where: dict[str, GgufFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self.where:
                    raise CheckpointError(f"{f.path}: tensor '{name}' is also in {self.where[name].path}")
                self.where[name] = f
        head = self.files[0]
        self.config = config_from_gguf(head.metadata, head.types, {n: f.info(n) for n, f in self.where.items()},
                                       str(self.path))
        self.released = {t.name: t for t in table.plan(self.config)}  # released name -> table.Tensor
        self.reader = TensorReader(lambda n: (self.where[n], n))

    # ---- names
    def gguf_names(self, t: table.Tensor) -> tuple[str, ...]:
        """The GGUF tensor(s) holding planned tensor `t`."""
        prefix = (table.GLOBAL if t.layer is None else table.LAYER).gguf_prefix.format(i=t.layer)
        return tuple(prefix + g for g in ((t.row.gguf,) if isinstance(t.row.gguf, str) else t.row.gguf))

    def _where(self, gguf: str) -> str:
        f = self.where.get(gguf)
        return str(f.path if f is not None else self.path)

    def _expected(self, t: table.Tensor) -> dict[str, tuple[int, ...]]:
        """{GGUF name: its expected NumPy shape} for planned tensor `t`."""
        cfg, names = self.config, self.gguf_names(t)
        if t.row.key in FUSED_SCORE:
            return {names[0]: (cfg.hidden_size,)}
        if t.row.key == "A_log":
            return {names[0]: (cfg.linear_attn_config.num_heads,)}
        if t.row.key == "kv_b_proj":
            nh, kl = cfg.num_attention_heads, cfg.kv_lora_rank
            return {names[0]: (nh, kl, cfg.qk_nope_head_dim), names[1]: (nh, cfg.v_head_dim, kl)}
        if t.expert is not None:
            return {names[0]: (cfg.num_experts,) + t.shape}
        return {names[0]: t.shape}

    # ---- the TensorSource interface
    def check(self, layer_ids, embedding, head) -> None:
        missing, bad, seen = [], [], set()
        for t in table.plan(self.config, layer_ids, embedding, head):
            for name, shape in self._expected(t).items():
                if name in seen:
                    continue
                seen.add(name)
                if name not in self.where:
                    missing.append(name)
                    continue
                code, found = self.where[name].info(name)
                if _squeezed(found) != _squeezed(shape):
                    bad.append(f"tensor '{name}' ({t.name}): expected shape {list(shape)}, found {code}{list(found)}")
                elif code in INTEGER:
                    bad.append(f"tensor '{name}' ({t.name}) is {code}, an integer type: a weight is a float or "
                               "quantised type (F32, F16, BF16, Q8_0, MXFP4, ...)")
                elif code not in NATIVE and not _gguf_installed():
                    bad.append(f"tensor '{name}' is {code}, read only through the optional `gguf` package: "
                               "pip install 'kimi-explore[gguf]'")
        if missing:
            raise CheckpointError(f"{self.path}: {len(missing)} tensor(s) the config requires are not in the GGUF: "
                                  f"{listed(missing)}")
        if bad:
            raise CheckpointError(f"{self.path}: " + "; ".join(bad))
        self._check_no_unexpected()
        for i in layer_ids:
            if self.config.is_kda_layer(i):
                a = self._values(f"blk.{i}.ssm_a", np.float64)
                if not np.all(np.isfinite(a) & (a < 0)):  # -inf: A = inf, another model that runs
                    raise CheckpointError(f"{self._where(f'blk.{i}.ssm_a')}: tensor 'blk.{i}.ssm_a' must be -exp(A_log), "
                                          f"finite and < 0 per head; found {a.tolist()}")
        for t in table.plan(self.config, layer_ids, embedding, head):  # the small vectors released in F32
            if t.dtype == table.F32:
                for g in self.gguf_names(t):
                    check_finite(self._where(g), g, self._values(g, np.float64))

    def _check_no_unexpected(self) -> None:
        """Every tensor in the GGUF is one the metadata's model reads (whatever `layers=` asks): one it
        does not account for (block_count too small, an attn_gate in some MLA layers only) would be
        ignored and another model run."""
        allowed = {g for t in table.plan(self.config) for g in self.gguf_names(t)}
        extra = [n for n in self.where if n not in allowed]
        if extra:
            raise CheckpointError(
                f"{self.path}: {len(extra)} tensor(s) in the GGUF are not part of the model its metadata describes "
                f"(block_count={self.config.num_hidden_layers}, attention.head_count_kv, and the tensors present "
                f"decide it), so the metadata and the weights disagree: {listed(extra)}"
            )

    def info(self, name: str):
        """(code, released shape). A tensor built from several GGUF tensors (kv_b_proj: attn_k_b + attn_v_b) is
        'BF16' (its bits kept by weight_dtype="bfloat16") only when every part is; parts of mixed types give
        the type they all widen to exactly, since bf16 bits would hold another part's values cast to integers."""
        t = self.released[name]
        codes = {self.where[g].info(g)[0] for g in self.gguf_names(t)}
        return (codes.pop() if len(codes) == 1 else "F64" if "F64" in codes else "F32"), t.shape

    def read(self, name: str, dtype, out=None) -> np.ndarray:
        t = self.released[name]
        out = np.empty(t.shape, dtype) if out is None else out
        if t.row.key == "kv_b_proj":  # [nh, dn + dv, kl] = per head [k_b^T; v_b]
            cfg, (k_name, v_name) = self.config, self.gguf_names(t)
            heads = out.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            shapes = self._expected(t)
            heads[:, : cfg.qk_nope_head_dim] = self._values(k_name, dtype).reshape(shapes[k_name]).transpose(0, 2, 1)
            heads[:, cfg.qk_nope_head_dim :] = self._values(v_name, dtype).reshape(shapes[v_name])
            return out
        return self._values(self.gguf_names(t)[0], dtype, out)

    def _values(self, gguf: str, dtype, out=None) -> np.ndarray:
        """GGUF tensor `gguf` in its NumPy shape as `dtype` (np.uint16: a BF16 tensor's bits), into `out` (its size)."""
        f = self.where[gguf]
        code, shape = f.info(gguf)
        out = np.empty(shape, dtype) if out is None else out
        if code in ggml_quants.FLOATS:  # exactly, straight into `out` (BF16 as bits for np.uint16)
            return self.reader.read(gguf, dtype, out=out)
        if np.dtype(dtype) == np.uint16:
            raise CheckpointError(f"{f.path}: tensor '{gguf}' is {code}; only BF16 tensors can be kept as bf16 bits")
        view = out.reshape(shape) if out.flags.c_contiguous else np.empty(shape, dtype)
        ggml_quants.dequantize(f.raw(gguf), code, shape, dtype, out=view)
        if view is not out:
            out[...] = view.reshape(out.shape)
        return out

    def score(self, kind, field, i) -> np.ndarray:
        t = self.released[kind.name(kind.keys(field)[0], i)]
        return self._values(self.gguf_names(t)[0], np.float64).reshape(-1)

    def kda_decay(self, i: int) -> np.ndarray:
        a_log = np.log(-self._values(f"blk.{i}.ssm_a", np.float64).reshape(-1)).astype(np.float32)
        return np.exp(a_log.astype(np.float64))

    def _expert_tensors(self, i: int) -> dict[str, tuple[int, ...]]:
        """{GGUF name: its NumPy shape [E, rows, cols]} of layer i's expert banks: w1, w3, w2. (`check` compared the stored
        shapes without their size-1 axes, which do not move a byte: each is read as this shape.)"""
        shapes = {}
        for k in table.MOE.expert_keys:
            shapes.update(self._expected(self.released[table.MOE.name(k, i, 0)]))
        return shapes

    def experts_quantized(self, i: int) -> bool:
        return all(self.where[n].info(n)[0] == "MXFP4" for n in self._expert_tensors(i))

    def experts(self, i, mode, *, dtype, xp, capacity, workspace):
        shapes = self._expert_tensors(i)
        gate, up, down = shapes
        if mode == "dense":
            (E, I, l), values = shapes[gate], lambda name: self._values(name, dtype).reshape(shapes[name])
            w13 = np.empty((E, 2 * I, l), dtype)
            w13[:, :I], w13[:, I:] = values(gate), values(up)
            return DenseExperts(xp.asarray(w13), xp.asarray(values(down)))
        mapped = mode == "mapped"

        def bank(name):
            E, rows, cols = shapes[name]
            blocks = self.where[name].raw(name).reshape(E, rows, cols // 32, ggml_quants.MXFP4_BLOCK)
            return blocks if mapped else xp.asarray(np.array(blocks))

        return GgmlExperts(w13_packed=(bank(gate), bank(up)), w13_scale=None, w2_packed=(bank(down),), w2_scale=None,
                           dtype=dtype, capacity=capacity, workspace=workspace, mapped=mapped, device=xp)

    def close(self) -> None:
        for f in self.files:
            f.close()


def _gguf_installed() -> bool:
    try:
        import gguf  # noqa: F401
    except ImportError:
        return False
    return True
