"""Tiny K3 checkpoints in the released layout: the writer, the random generator, and the two tiny models.

    tiny_checkpoint()          the TRAINED tiny K3, shipped in the package (the CLI's, notebooks' default)
    random_tiny_checkpoint()   the RANDOM-weight tiny K3: the tests' fixture, `tests/data/tiny_k3`
    save_checkpoint(dir, text_config, tensors)   given weights -> the released layout (the trainer's export)
    write_checkpoint(dir, text_config, seed=0)   deterministic random weights -> the released layout

`python -m kimi_explore.weights.tiny_model --out tests/data/tiny_k3` wrote the random fixture; tests
use `write_checkpoint` with other shapes to make sure the decoder assumes nothing the released
config does not. The layout is the real one: the `kimi_k3` config shell, `language_model.` names,
BF16 matrices, F32 small vectors, `A_log` head_dim wide and zero-padded, MXFP4 routed experts,
sharded safetensors behind `model.safetensors.index.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import CheckpointError
from ..model.config import KimiDecoderConfig
from . import checkpoint_table as table
from . import mxfp4
from .checkpoint import INDEX_FILE
from .safetensors_io import write_safetensors

BF16 = ml_dtypes.bfloat16

# The random tiny fixture's text_config, and the base every other tiny config overrides: K3's layer
# pattern with a final MLA pair as K3 ends (layers 15 and 16; K3's 92 and 93), a dense first layer,
# block size 4, at toy widths, with a byte-level vocabulary.
TINY_TEXT_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 192,
    "num_hidden_layers": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 16,
    "num_experts_per_token": 4,
    "num_shared_experts": 2,
    "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 64,
    "latent_moe_use_norm": True,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 1.0,
    "num_expert_group": 1,
    "topk_group": 1,
    "use_grouped_topk": True,
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "attn_res_block_size": 4,
    "max_position_embeddings": 4096,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": 0,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 15, 16],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14],
        "num_heads": 4,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    },
    "dtype": "bfloat16",
}

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                        "dynamic": False, "scale_dtype": "torch.uint8"},
        }
    },
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


def make_text_config(**overrides) -> dict:
    """The random tiny fixture's text_config with `overrides` (use `linear_attn_config=` for the KDA part)."""
    cfg = copy.deepcopy(TINY_TEXT_CONFIG)
    cfg.update(copy.deepcopy(overrides))
    return cfg


def _draw(rng: np.random.Generator, init: tuple, shape: tuple, heads: int) -> np.ndarray:
    """Float64 values for a table row's `init` (see `checkpoint_table`); the writer casts them to the disk dtype."""
    kind, *args = init
    if kind == "normal":  # std gain / sqrt(fan-in): unit-scale outputs for unit-scale inputs
        return rng.standard_normal(shape) * (args[0] / np.sqrt(max(shape[-1], 1)))  # (a [d, 0] matrix: no shared experts)
    if kind == "std":
        return rng.standard_normal(shape) * args[0]
    if kind == "gain":
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if kind == "uniform":
        return rng.uniform(args[0], args[1], shape)
    if kind == "per_head":  # one value per head, zero-padded to the stored width (A_log as released)
        a = np.zeros(shape if heads <= shape[0] else (heads,))  # more heads than the width: stored [H] (the row's `also`)
        a[:heads] = rng.uniform(args[0], args[1], heads)
        return a
    if kind == "spread":  # distinct values, so the router bias changes which experts win
        return rng.permutation(np.linspace(-args[0], args[0], shape[0]))
    raise ValueError(f"unknown init {init!r} in the checkpoint table")


def _tensors(text_config: dict, seed: int, experts: str) -> dict[str, np.ndarray]:
    """Every language-model tensor of the table (unprefixed names), drawn in table order, with scales
    that exercise each nonlinearity. Routed experts are float (packed on save) or BF16 (kept dense)."""
    cfg = KimiDecoderConfig.from_dict(text_config)
    rng = np.random.default_rng(seed)
    heads = cfg.linear_attn_config.num_heads
    t: dict[str, np.ndarray] = {}
    for x in table.plan(cfg):
        a = _draw(rng, x.row.init, x.shape, heads)
        t[x.name] = a.astype(BF16) if x.dtype == table.MXFP4 and experts == "bf16" else a
    return t


def _shard_key(name: str, n_layers: int, shards: int) -> int:
    """Shard 0 holds the global tensors; layers are spread evenly over the others (as the release does)."""
    parts = name.split(".")
    if shards == 1 or parts[1] != "layers":
        return 0
    return 1 + int(parts[2]) * (shards - 1) // n_layers


def write_checkpoint(path, text_config: dict | None = None, *, seed: int = 0, shards: int = 1,
                     experts: str = "mxfp4", prefix: str = table.RELEASE_PREFIX, index: bool = True) -> Path:
    """Write a checkpoint of random weights; returns its path. `experts` is "mxfp4" or "bf16". Its
    model_card.json says the weights are random (`describe_checkpoint`, the CLI's header), in copies too."""
    text_config = make_text_config() if text_config is None else text_config
    if experts not in ("mxfp4", "bf16"):
        raise ValueError(f"experts={experts!r}: expected 'mxfp4' or 'bf16'")
    out = save_checkpoint(path, text_config, _tensors(text_config, seed, experts), shards=shards, prefix=prefix,
                          index=index)
    (out / "model_card.json").write_text(json.dumps({"weights": "random", "seed": seed}) + "\n", encoding="utf-8")
    return out


_NUMPY_DTYPES = {table.BF16: BF16, table.F32: np.float32}


def _released(cfg: KimiDecoderConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`tensors` checked against the table and cast to their disk dtypes; MXFP4 experts given dense packed."""
    out, problems, used = {}, [], set()

    def take(name: str, want: tuple, what: str = "a float array"):
        a = np.asarray(tensors[name])
        used.add(name)
        is_float = a.dtype.kind == "f" or a.dtype == BF16
        if (what == "uint8" and a.dtype != np.uint8) or (what != "uint8" and not is_float) or a.shape != want:
            problems.append(f"'{name}': expected {what} of shape {list(want)}, got {a.dtype} {list(a.shape)}")
        return a

    for t in table.plan(cfg):
        if t.dtype != table.MXFP4:
            if t.name not in tensors:
                problems.append(f"'{t.name}': missing ({t.dtype} {list(t.shape)})")
                continue
            a = np.asarray(tensors[t.name])
            want = t.also if t.also is not None and a.shape == t.also else t.shape
            out[t.name] = take(t.name, want).astype(_NUMPY_DTYPES[t.dtype])
        elif t.name in tensors:  # dense: packed to MXFP4, unless BF16 (kept dense, as a bf16-experts checkpoint)
            a = take(t.name, t.shape)
            if a.dtype == BF16:
                out[t.name] = a
            elif a.shape == t.shape:
                if a.shape[-1] % mxfp4.GROUP:  # MXFP4 scales groups of 32 along each row
                    raise ValueError(f"'{t.name}' {list(a.shape)}: MXFP4 experts need rows that are a multiple of "
                                     f"{mxfp4.GROUP} wide (moe_intermediate_size and routed_expert_hidden_size); "
                                     "write them with experts='bf16'")
                packed, scale = table.mxfp4_names(t.name)
                out[packed], out[scale] = mxfp4.quantize(a)
        else:  # already packed: the U8 pair as released
            for d in table.on_disk(t):
                if d.name not in tensors:
                    problems.append(f"'{t.name}': missing (a float {list(t.shape)} or its MXFP4 pair {d.name})")
                    break
                out[d.name] = take(d.name, d.shape, "uint8")
    problems += [f"'{n}': not a tensor of this config (no such row in checkpoint_table)" for n in sorted(set(tensors) - used)]
    if problems:
        shown = "; ".join(problems[:12]) + (f"; and {len(problems) - 12} more" if len(problems) > 12 else "")
        raise ValueError(f"save_checkpoint: {len(problems)} problem(s) with the tensors for this config: {shown}")
    return out


def save_checkpoint(path, text_config: dict, tensors: dict[str, np.ndarray], *, shards: int = 1,
                    prefix: str = table.RELEASE_PREFIX, index: bool = True) -> Path:
    """Write `tensors` (unprefixed released names -> arrays in their on-disk shapes) in the released layout.

    The names, shapes and disk dtypes are those of `checkpoint_table` for `text_config`: every
    tensor must be there, with its shape, and nothing else (else ValueError listing each problem).
    Each float tensor is cast to its released dtype (F32 for KDA's small tensors and the router
    bias, BF16 for the rest); a routed expert given dense as `...experts.{e}.w{1,2,3}.weight`
    (float) is packed to MXFP4 (`weight_packed` / `weight_scale`), unless given as BF16 (kept
    dense); a given U8 pair is written as it is. Writes config.json (the `kimi_k3` shell with
    `quantization_config` when any expert is MXFP4), the shards and `model.safetensors.index.json`.
    """
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"save_checkpoint: shards={shards!r}; expected a positive int (the number of safetensors files)")
    if not index and shards > 1:  # the loader finds a sharded checkpoint's files through its index
        raise ValueError(f"save_checkpoint: index=False with shards={shards}; a checkpoint of several files is loaded "
                         f"through its {INDEX_FILE}: keep index=True, or write one file (shards=1)")
    path = Path(path)
    if path.exists() and not path.is_dir():  # (else a bare FileExistsError from mkdir)
        raise FileExistsError(f"save_checkpoint: {path} is a file; expected a checkpoint directory (new, or one to "
                              "write over)")
    out = _released(KimiDecoderConfig.from_dict(text_config), tensors)
    path.mkdir(parents=True, exist_ok=True)
    quantised = any(n.endswith("weight_packed") for n in out)
    tensors = {prefix + k: v for k, v in out.items()}
    tc = dict(text_config)
    if quantised:
        tc["quantization_config"] = QUANTIZATION_CONFIG
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "dtype": "bfloat16",
              "bos_token_id": tc.get("bos_token_id"), "eos_token_id": tc.get("eos_token_id"),
              "pad_token_id": tc.get("pad_token_id"), "tie_word_embeddings": bool(tc.get("tie_word_embeddings", False)),
              "text_config": tc, "vision_config": None}
    if not index and (path / INDEX_FILE).exists():  # the loader would read it, and the old shards it names
        raise FileExistsError(f"{path / INDEX_FILE}: another checkpoint's index is there; a checkpoint written without "
                              "one (index=False) would load as that one. Write into an empty directory")
    files: dict[str, object] = {}  # file name -> what to write: every file written beside, then renamed (below)
    if shards == 1 and not index:
        files["model.safetensors"] = tensors
    else:
        n_layers = text_config["num_hidden_layers"]
        groups: dict[int, dict] = {}
        for name, a in tensors.items():
            groups.setdefault(_shard_key(name[len(prefix):], n_layers, shards), {})[name] = a
        # numbered among the shards written: fewer layers than shards leaves some empty, and "-of-00008" over 7
        # files would say a file is missing
        names = {k: "model.safetensors" if shards == 1 else f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors"
                 for j, k in enumerate(sorted(groups))}
        weight_map = {}
        for k, group in sorted(groups.items()):
            files[names[k]] = group
            weight_map.update({n: names[k] for n in group})
        total = sum(a.nbytes for a in tensors.values())
        index_doc = {"metadata": {"total_size": int(total)}, "weight_map": dict(sorted(weight_map.items()))}
        files[INDEX_FILE] = json.dumps(index_doc, indent=2) + "\n"
    files["config.json"] = json.dumps(config, indent=2) + "\n"
    _write_all(path, files)
    return path


def _write_all(path: Path, files: dict) -> None:
    """Write {name: tensors or text} into `path`: each to a temporary name first, then all renamed, the config last.
    Over an earlier checkpoint, an interrupted write leaves that one whole (written straight, a killed export left
    new and old shards of the same shapes side by side: a mix that loads)."""
    tmp = {name: path / f".{name}.{os.getpid()}.tmp" for name in files}
    try:
        for name, content in files.items():
            if isinstance(content, str):
                tmp[name].write_text(content)
            else:
                write_safetensors(tmp[name], content)
        for name in files:
            os.replace(tmp[name], path / name)
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)


# The trained model ships inside the package (package data: a wheel carries it). The random one is the
# tests' and benchmarks' fixture, in the source tree only: its predictions mean nothing to a user.
TRAINED_TINY_DIR = Path(__file__).resolve().parents[1] / "data" / "tiny_k3_pydoc"
RANDOM_TINY_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny_k3"
RANDOM_TINY_SEED = 2026
RANDOM_TINY_SHARDS = 5


def tiny_checkpoint() -> Path:
    """The package's default model: a tiny K3 trained on Python's `pydoc_data.topics`
    (`kimi_explore/data/tiny_k3_pydoc`, built by `python -m training.train_tiny`; its README.md is
    the model card). Never a random stand-in: if it is missing the install is broken, and this says so."""
    if not (TRAINED_TINY_DIR / "config.json").is_file():
        raise CheckpointError(f"{TRAINED_TINY_DIR}: the trained tiny model is not there (expected its config.json "
                              "and shards as package data); reinstall kimi-explore, or pass a checkpoint explicitly")
    return TRAINED_TINY_DIR


def random_tiny_checkpoint() -> Path:
    """The random-weight tiny model (16 layers, K3's layer pattern): the tests' and benchmarks' fixture,
    `tests/data/tiny_k3` in a source checkout. It is not installed with the package; outside a
    checkout write the same bytes with `python -m kimi_explore.weights.tiny_model --out DIR`."""
    if not (RANDOM_TINY_DIR / "config.json").is_file():
        raise CheckpointError(f"{RANDOM_TINY_DIR}: the random tiny model is a fixture of the source checkout, not "
                              "installed with the package; write it with `python -m kimi_explore.weights.tiny_model "
                              "--out DIR`")
    return RANDOM_TINY_DIR


def is_random_card(card) -> bool:
    """Whether a parsed model_card.json is the one `write_checkpoint` writes beside random weights."""
    return isinstance(card, dict) and card.get("weights") == "random"


def random_weights(path) -> bool:
    """Whether the checkpoint at `path` says its weights are random (its model_card.json, `write_checkpoint`'s)."""
    try:
        return is_random_card(json.loads((Path(path) / "model_card.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):  # no card, or one `describe_checkpoint` names as damaged
        return False


def describe_checkpoint(path) -> str:
    """One line saying what a tiny checkpoint is, from its `model_card.json` when it has one."""
    card = Path(path) / "model_card.json"
    if card.exists():
        try:
            c = json.loads(card.read_text(encoding="utf-8"))
        except ValueError as e:
            raise CheckpointError(f"{card}: not valid JSON ({e})") from None
        if is_random_card(c):
            return f"{Path(path).name}: random weights (seed {c.get('seed')}, `write_checkpoint`)"
        need = {"name": str, "corpus": str, "params": int, "val_bits_per_byte": (int, float)}  # what the line shows
        bad = [k for k, t in need.items() if not isinstance(c, dict) or not isinstance(c.get(k), t)]
        if bad:
            found = {k: c.get(k) for k in bad} if isinstance(c, dict) else c
            raise CheckpointError(f"{card}: a model card needs name and corpus (text), params (an int) and "
                                  f"val_bits_per_byte (a number); found {found!r:.200}")
        return (f"{c['name']}: a tiny K3 trained on {c['corpus']} ({c['params']:,} parameters), "
                f"{c['val_bits_per_byte']:.2f} bits/byte on its held-out validation split")
    return f"{Path(path).name}: random weights (no model card)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write the random-weight tiny K3 (the tests' fixture, tests/data/tiny_k3; "
                                "deterministic: the same bytes on every machine).")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=RANDOM_TINY_SEED)
    p.add_argument("--shards", type=int, default=RANDOM_TINY_SHARDS)
    args = p.parse_args(argv)
    out = write_checkpoint(args.out, seed=args.seed, shards=args.shards)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
