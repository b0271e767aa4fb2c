"""From the trainer's float weights to the released layout, and back.

`released_tensors(model)` gives every UNPREFIXED released tensor name -> float array in its on-disk
shape (routed experts dense, per expert, as `experts.{e}.w{1,2,3}.weight` [out, in]); the package's
writer (`kimi_explore.weights.tiny_model.save_checkpoint`) casts to BF16 / F32 and packs the experts
to MXFP4. `round_to_released(model)` applies the same rounding in torch (what the checkpoint will
hold), and `load_exported(dir)` reads a written checkpoint back into a trainer model: the parity
check runs the trainer on exactly the weights `kimi_explore` decodes.

Every name, disk dtype and packing comes from the package's checkpoint table
(`kimi_explore.weights.checkpoint_table`), planned for the model's config: the trainer's parameters
are the released names, except that each layer's routed experts are one stacked parameter named by
the table row's key (`...block_sparse_moe.w1` [E, I, l] holds `...block_sparse_moe.experts.{e}.w1.weight`).
A trainer parameter the table does not plan, or a planned tensor the trainer lacks, is an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from kimi_explore.weights import checkpoint_table as table

from .model import KimiK3, mxfp4_round


def trainer_name(t: table.Tensor) -> str:
    """The trainer's parameter holding planned tensor `t` (for an expert: row `t.expert` of it)."""
    if t.expert is None:
        return t.name
    return t.name.split(f"experts.{t.expert}.")[0] + t.row.key


def _checked_plan(model: KimiK3, names) -> list[table.Tensor]:
    """The table's plan for the model's config, checked against the trainer's parameter names."""
    planned = table.plan(model.cfg)
    want = {trainer_name(t) for t in planned}
    extra, missing = sorted(set(names) - want), sorted(want - set(names))
    if extra or missing:
        raise ValueError(f"the trainer's parameters and the checkpoint table disagree: not in the table {extra[:5]}, "
                         f"missing from the trainer {missing[:5]}")
    return planned


def released_tensors(model: KimiK3) -> dict[str, np.ndarray]:
    sd = model.state_dict()
    out: dict[str, np.ndarray] = {}
    for t in _checked_plan(model, sd):
        a = sd[trainer_name(t)].detach()
        a = a[t.expert] if t.expert is not None else a
        out[t.name] = np.ascontiguousarray(a.to(torch.float32).cpu().numpy())
    return out


@torch.no_grad()
def round_to_released(model: KimiK3) -> None:
    """In place: round every tensor as the checkpoint stores it (the table's disk dtype: BF16 rounded,
    F32 kept, MXFP4 experts through BF16 then MXFP4)."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    dtype = {trainer_name(t): t.dtype for t in _checked_plan(model, params)}
    for name, p in params.items():
        if dtype[name] == table.MXFP4:
            p.copy_(mxfp4_round(p.to(torch.bfloat16).to(torch.float32)))
        elif dtype[name] == table.BF16:
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def save(model: KimiK3, path, shards: int = 3) -> Path:
    """Write the checkpoint through the package's writer."""
    from kimi_explore.weights.tiny_model import save_checkpoint

    return Path(save_checkpoint(path, model.text_config, released_tensors(model), shards=shards))


def load_exported(path) -> KimiK3:
    """A trainer model holding exactly the values of a written checkpoint (BF16 widened, MXFP4
    dequantised), in float32."""
    import ml_dtypes  # noqa: F401  (lets safetensors hand out BF16 arrays)
    from safetensors import safe_open

    from kimi_explore.weights import mxfp4

    path = Path(path)
    tc = json.loads((path / "config.json").read_text())["text_config"]
    tc.pop("quantization_config", None)  # the writer adds it again
    raw: dict[str, np.ndarray] = {}
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(path / fname, framework="numpy") as f:
            for n in f.keys():
                raw[n.removeprefix(table.RELEASE_PREFIX)] = f.get_tensor(n)
    model = KimiK3(tc)
    sd = model.state_dict()
    values: dict[str, list] = {}  # trainer name -> [its value], or [expert 0, expert 1, ...] for a stacked bank
    for t in _checked_plan(model, sd):
        if t.name in raw:  # dense (an expert too, when written as BF16)
            a = raw[t.name]
        else:
            a = mxfp4.dequantize(*(raw[n] for n in table.mxfp4_names(t.name)))
        values.setdefault(trainer_name(t), []).append(np.asarray(a).astype(np.float32))
    new = {name: torch.from_numpy(np.stack(v) if sd[name].ndim == v[0].ndim + 1 else v[0]) for name, v in values.items()}
    model.load_state_dict(new)
    model.eval()
    return model
