"""`from_pretrained(path, ...)`: open a checkpoint as a `TensorSource`, check it, build the weight records.

    path  a safetensors checkpoint directory (`safetensors_source`), a Hub repo id 'org/name'
          (only the shards the requested layers need are fetched: `hub.py`), or a llama.cpp GGUF
          file, split or not (`gguf_source`)

Order, so that nothing is returned half-loaded: options checked, config read, layers resolved, the
whole plan checked against the files (`source.check`: names, dtypes, shapes, file sizes, and no
tensor the config's model would ignore: a config that disagrees with its weights is refused), expert
mode and cache size resolved (`load_options`), and only then anything allocated and read
(`records.build_weights`). Every problem raises `CheckpointError` / `ConfigError` / `ValueError`
naming the file, tensor, key or argument.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..backend import resolve_device, resolve_dtype
from ..model.config import KimiDecoderConfig
from ..model.kimi_decoder import KimiDecoderWeights
from . import load_options as opts
from .bf16_matvec import runs as bf16_kernel_runs
from .checkpoint import resolve_layers
from .gguf_source import GgufSource, is_gguf
from .hub import fetch_config, resolve_checkpoint
from .records import BuildOptions, build_weights
from .safetensors_source import SafetensorsSource
from .tensor_source import TensorSource

__all__ = ["check_options", "hub_options", "load_weights", "open_source", "read_config"]

HUB_OPTIONS = ("revision", "cache_dir", "local_files_only", "token")  # what `open_source` and `read_config` pass to the Hub


def hub_options(load_kwargs: dict) -> dict:
    """The Hub's keywords among `from_pretrained`'s (a pipeline reads the config, or a stage probes its layers, with
    them)."""
    return {k: load_kwargs[k] for k in HUB_OPTIONS if k in load_kwargs}


def open_source(path, *, layers=None, revision=None, cache_dir=None, local_files_only=None, token=None,
                progress: bool = True, embedding: bool = True, head: bool = True) -> TensorSource:
    """The checkpoint at `path` (directory, Hub repo id or GGUF file) opened as a `TensorSource`, its config read."""
    if is_gguf(path):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repo ids, but {path} is a GGUF file")
        return GgufSource(path)
    path = resolve_checkpoint(path, layers=layers, revision=revision, cache_dir=cache_dir,
                              local_files_only=local_files_only, token=token, progress=progress,
                              embedding=embedding, head=head)
    return SafetensorsSource(path, KimiDecoderConfig.from_file(path / "config.json"))


def read_config(path, *, revision=None, cache_dir=None, local_files_only=None, token=None) -> KimiDecoderConfig:
    """The config of the checkpoint at `path` without loading it: a directory's config.json, a GGUF's
    metadata (its header only), or config.json alone from the Hub."""
    if is_gguf(path):
        source = GgufSource(path)
        source.close()
        return source.config
    if Path(path).is_dir():
        return KimiDecoderConfig.from_file(Path(path) / "config.json")
    return KimiDecoderConfig.from_file(fetch_config(str(path), revision=revision, cache_dir=cache_dir,
                                                    local_files_only=local_files_only, token=token))


def check_options(who: str, options: dict, fixed=()) -> None:
    """Refuse, before anything is opened, the keyword arguments `load_weights` would refuse by their values alone (an
    unknown name, a dtype, weight_dtype, bf16_matvec or experts / expert_cache_size out of range); `fixed`: names
    the caller sets itself (a RayPipeline's per stage). What depends on the device or the checkpoint is left to it."""
    takes = [k for k in inspect.signature(load_weights).parameters if k != "path"]
    unknown = [k for k in options if k not in takes]
    if unknown:
        raise TypeError(f"{who}: unexpected keyword argument(s) {unknown}: from_pretrained takes "
                        f"{[k for k in takes if k not in fixed]}")
    set_here = [k for k in options if k in fixed]
    if set_here:
        raise TypeError(f"{who}: {set_here} are set by {who} itself; leave them out")
    dt = resolve_dtype(options.get("dtype", "float32"))
    opts.resolve_weight_dtype(options.get("weight_dtype"), dt)
    opts.resolve_bf16_matvec(options.get("bf16_matvec", "auto"))
    opts.check_forms(options.get("experts", "auto"), options.get("expert_cache_size"))


def load_weights(path, *, layers=None, device: str = "auto", dtype: str = "float32", weight_dtype: str | None = None,
                 experts: str = "auto", expert_cache_size: int | None = None, bf16_matvec: str = "auto",
                 embedding: bool = True, head: bool = True, revision: str | None = None,
                 cache_dir=None, local_files_only: bool | None = None, token=None, progress: bool = True) -> KimiDecoderWeights:
    """Load a K3 checkpoint (all layers, or the 0-based `layers` chosen) onto `device`.

    path: a checkpoint directory, or a Hub repo id ('org/name'): then only config, index, tokenizer
        files and the shards of the requested layers are fetched (`kimi_explore.weights.hub`; `revision`,
        `cache_dir`, `local_files_only`, `token` go to huggingface_hub; HF_HUB_OFFLINE=1 works);
        or a llama.cpp `kimi-k3` GGUF file ('model.gguf', or any split '...-00001-of-00003.gguf'):
        the weights llama.cpp runs (`kimi_explore.weights.gguf_source`).
    dtype: compute dtype of activations and widened weights ("float32" | "float64").
    weight_dtype: None keeps every matrix in `dtype`; "bfloat16" keeps the trunk's matrices stored as BF16
        on disk as bf16 bits (half the memory), multiplied as `bf16_matvec` says. Routed experts stored as
        BF16 (a bf16-experts checkpoint, `make-tiny`'s default) stay a dense bank in `dtype`: the release's
        are MXFP4, kept packed (`experts=`).
    bf16_matvec: with weight_dtype="bfloat16": "auto" (default) = the compiled bf16 kernel where it
        runs (CPU, float32, built; float32 sums in another order than BLAS, ~1e-7), else widening;
        "widen" = widen each matrix per use, then BLAS (logits bit-identical to the float32 trunk,
        slower on the CPU); "kernel" = require the kernel.
    experts: "dense" dequantises every routed expert at load; "packed" keeps the MXFP4 bytes and
        dequantises the selected ones per token (same logits bit for bit) or, with no cache on the
        CPU, multiplies them fused (see expert_cache_size); "mapped" is "packed" with the bytes left
        in the shard files as read-only memory maps, nothing copied at load, paged in by the OS on
        first use (bit-identical to "packed" with the same cache size; on a GPU the selected
        experts are copied to the device per use; do not overwrite the shard files in place while
        the model lives: it would run the new bytes); "auto" (default) is dense when all requested
        experts dequantised fit in 1 GiB (the tiny models), else packed (K3); packed whenever
        expert_cache_size is given.
    expert_cache_size: with packed or mapped experts (refused with "dense"), dequantised experts kept PER
        LAYER in an LRU cache, at most the layer's num_experts (a larger number keeps them all; capped);
        0 = no cache: on the CPU in float32 the selected experts are then multiplied straight from
        their packed bytes by the compiled kernel (`mxfp4_matvec`, when built; the same weights,
        float32 sums in another order), else dequantised per token. None = all of a layer's
        experts if they fit in 512 MiB (the tiny models); otherwise 0 on the CPU with the kernel
        (K3: reading 280 MB packed beats reading 2.1 GB dequantised), else as many as fit (3 of K3's).
    embedding=False / head=False: leave out the token embedding (`embed_tokens` is None) / the output
        mix, final norm and lm_head (None): a pipeline stage after the first / before the last, which
        then reads neither those tensors nor a shard that holds only them.
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"from_pretrained: path={path!r}: expected a checkpoint directory, a .gguf file or a Hub repo "
                        f"id ('org/name') as a str or Path (ke.tiny_checkpoint() is the embedded model), "
                        f"got {'an empty string' if isinstance(path, str) else type(path).__name__}")
    xp, dev = resolve_device(device)
    dt = resolve_dtype(dtype)
    bf16 = opts.resolve_weight_dtype(weight_dtype, dt)
    bf16_kernel = opts.resolve_bf16_matvec(bf16_matvec)
    opts.check_forms(experts, expert_cache_size)
    if bf16_kernel is not None and not bf16:
        raise ValueError(f"bf16_matvec={bf16_matvec!r} chooses how bf16 weights are multiplied, and needs "
                         f"weight_dtype='bfloat16'; got weight_dtype={weight_dtype!r} (leave bf16_matvec='auto')")
    opts.check_bf16_kernel(bf16_kernel, xp, dt, dev)
    if isinstance(layers, Iterator):  # one pass only: the Hub plan would consume it before the checks see it
        layers = list(layers)
    source = open_source(path, layers=layers, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                         token=token, progress=progress, embedding=embedding, head=head)
    try:
        cfg = source.config
        layer_ids = resolve_layers(layers, cfg.num_hidden_layers)
        source.check(layer_ids, embedding, head)
        mode = opts.resolve_experts(experts, cfg, layer_ids, source, dt, expert_cache_size)
        cache_size = opts.resolve_cache_size(expert_cache_size, cfg, dt, xp)
        extra = {"experts": mode, "expert_cache_size": cache_size if mode in ("packed", "mapped") else None,
                 "weight_dtype": "bfloat16" if bf16 else np.dtype(dt).name,
                 "bf16_matvec": (("kernel" if bf16_kernel is not False and bf16_kernel_runs(xp, dt) else "widen")
                                 if bf16 else None)}
        o = BuildOptions(xp=xp, device=dev, dtype=dt, bf16=bf16, bf16_kernel=bf16_kernel, experts=mode,
                         cache_size=cache_size, embedding=embedding, head=head)
        return build_weights(source, layer_ids, o, extra)
    finally:
        source.close()
