"""What a loaded model keeps resident, by component: `memory_report(weights)`.

    >>> print(memory_report(weights))        # a table; the object is a dict {component: bytes}
    component                                 bytes      MiB   share
    embed_tokens                          1,048,576      1.0   12.3%
    ...

Counts the arrays the weights hold (on their device: host RAM for NumPy, GPU memory for CuPy),
at their resident size: bf16 bits for `weight_dtype="bfloat16"` matrices, uint8 for packed
experts, plus the dequantised-expert caches as they are now, and the model's workspace
(`weights.workspace`): the bf16 widening scratch and the buffers of the experts a token dequantises.
Decode state (KDA matrices, MLA caches) is not weights and is not counted.

Mapped experts (experts="mapped") are not resident: their bytes stay in the shard files and the
OS pages them in and out. They are listed apart, in `report.mapped` ({component: bytes}) and
below the total in the table, never in `total`.
"""

from __future__ import annotations

import dataclasses

__all__ = ["MemoryReport", "layer_bytes", "memory_report"]

COMPONENTS = (
    "embed_tokens",
    "lm_head",
    "final norm + output mix",
    "layer norms + attn-res scores",
    "attention (KDA)",
    "attention (MLA)",
    "dense MLP",
    "MoE router + latent projections + shared experts",
    "routed experts, MXFP4 packed",
    "routed experts, dequantised (dense bank)",
    "routed experts, dequantised (LRU caches)",
    "bf16 widening scratch",
    "dequantise workspace",
)
MAPPED = "routed experts, MXFP4 mapped from the shard files"


def _nbytes(obj) -> int:
    """Resident bytes of an array, a Bf16Matrix, or every array field of a weights record."""
    if obj is None or isinstance(obj, (int, float, bool, str)):
        return 0
    if dataclasses.is_dataclass(obj):
        return sum(_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj) if not f.name.startswith("_"))
    n = getattr(obj, "nbytes", None)
    return int(n) if n is not None else 0


# a layer's small vectors, by the half of the layer that reads them
ATTENTION_NORMS = ("input_layernorm", "attn_res_score")
FFN_NORMS = ("post_attention_layernorm", "mlp_res_score")


def _moe_trunk(ffn) -> int:
    """A MoE layer's router, latent projections and shared experts: every field but the routed experts."""
    return sum(_nbytes(getattr(ffn, f.name)) for f in dataclasses.fields(ffn) if f.name != "experts")


def layer_bytes(layer) -> dict[str, int]:
    """Resident bytes of one decoder layer that every token reads, by half of the layer:
    "attention": its norm, attn-res score and the attention (KDA or MLA);
    "ffn trunk": its norm, attn-res score and the dense MLP, or the MoE's router, latent projections and
    shared experts. The routed experts are apart: a token reads only the ones it selects."""
    ffn = layer.ffn
    return {"attention": sum(_nbytes(getattr(layer, n)) for n in ATTENTION_NORMS) + _nbytes(layer.attention),
            "ffn trunk": sum(_nbytes(getattr(layer, n)) for n in FFN_NORMS)
            + (_moe_trunk(ffn) if ffn.kind == "moe" else _nbytes(ffn))}


class MemoryReport(dict):
    """{component: resident bytes}, printed as a table. `total` is their sum; `device` where they live;
    `mapped`: {component: bytes} left in the checkpoint files (memory-mapped, paged by the OS)."""

    def __init__(self, parts: dict[str, int], device: str, mapped: dict[str, int] | None = None):
        super().__init__(parts)
        self.device = device
        self.mapped = dict(mapped or {})

    @property
    def mapped_total(self) -> int:
        return sum(self.mapped.values())

    @property
    def total(self) -> int:
        return sum(self.values())

    def table(self) -> str:
        total = self.total or 1
        extra = {f"+ {k} (not resident)": v for k, v in self.mapped.items()}
        w = max(len(k) for k in list(self) + list(extra)) + 2
        lines = [f"{'component':<{w}}{'bytes':>16}{'MiB':>11}{'share':>8}"]
        for k, v in self.items():
            lines.append(f"{k:<{w}}{v:>16,}{v / 2**20:>11.1f}{100 * v / total:>7.1f}%")
        lines.append(f"{'total (' + self.device + ')':<{w}}{self.total:>16,}{self.total / 2**20:>11.1f}{100.0:>7.1f}%")
        lines += [f"{k:<{w}}{v:>16,}{v / 2**20:>11.1f}" for k, v in extra.items()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle) -> None:  # IPython/Jupyter show the table
        p.text(self.table())


def memory_report(weights) -> MemoryReport:
    """Resident bytes of `weights` (a KimiDecoderWeights) by component."""
    if not hasattr(weights, "embed_tokens"):
        raise TypeError(f"memory_report: expected the weights from ke.from_pretrained(...), got {type(weights).__name__}"
                        + (" (a session's are session.weights)" if hasattr(weights, "weights") else ""))
    parts, mapped = dict.fromkeys(COMPONENTS, 0), {}
    parts["embed_tokens"] = _nbytes(weights.embed_tokens)
    if weights.lm_head is not weights.embed_tokens:  # tied embeddings are counted once
        parts["lm_head"] = _nbytes(weights.lm_head)
    parts["final norm + output mix"] = _nbytes(weights.norm) + _nbytes(weights.output_attn_res_score)
    for layer in weights.layers:
        parts["layer norms + attn-res scores"] += sum(_nbytes(getattr(layer, n)) for n in ATTENTION_NORMS + FFN_NORMS)
        kind = f"attention ({layer.attention.kind.upper()})"
        parts[kind] += _nbytes(layer.attention)
        ffn = layer.ffn
        if ffn.kind != "moe":
            parts["dense MLP"] += _nbytes(ffn)
            continue
        bank = ffn.experts
        parts["MoE router + latent projections + shared experts"] += _moe_trunk(ffn)
        if getattr(bank, "mapped_bytes", 0):  # MXFP4 left in the checkpoint files
            mapped[MAPPED] = mapped.get(MAPPED, 0) + bank.mapped_bytes
        if hasattr(bank, "packed_bytes"):  # an MXFP4 bank (experts.PackedExperts and its kinds)
            parts["routed experts, MXFP4 packed"] += bank.packed_bytes
            parts["routed experts, dequantised (LRU caches)"] += bank.cached_bytes
        else:  # dequantised up front (latent_moe.DenseExperts: w13, w2)
            parts["routed experts, dequantised (dense bank)"] += _nbytes(bank)
    ws = weights.workspace
    if ws is not None:
        parts["bf16 widening scratch"] = ws.widening_bytes
        parts["dequantise workspace"] = ws.dequantised_bytes
    return MemoryReport(parts, weights.device, mapped)
