"""Measure an exported tiny K3 through `kimi_explore` and write its model card.

    python -m training.make_card --checkpoint kimi_explore/data/tiny_k3_pydoc

Every figure is decoded by `kimi_forward_token` from the checkpoint on disk (never the trainer's
float weights). Writes model_card.json (the figures; tests recompute the short-slice ones) and
README.md (the card) next to the checkpoint. Needs no torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

SLICE_WINDOWS = 2  # the short slice the tests recompute: the first 2 windows of each split
WINDOW = 256


def measure(checkpoint, max_windows: int | None = None) -> dict:
    import kimi_explore as ke
    from kimi_explore.analysis import learned
    from kimi_explore.analysis.routing_stats import routing_stats

    path = Path(checkpoint)
    w = ke.from_pretrained(str(path), device="cpu")
    train, val = learned.split_corpus(learned.pydoc_corpus())
    train_slice = train[-len(val) :]
    t0 = time.time()
    fig = {
        "val_bits_per_byte": learned.bits_per_byte(w, val, WINDOW, max_windows=max_windows),
        "train_bits_per_byte": learned.bits_per_byte(w, train_slice, WINDOW, max_windows=max_windows),
        "val_slice_bits_per_byte": learned.bits_per_byte(w, val, WINDOW, max_windows=SLICE_WINDOWS),
        "train_slice_bits_per_byte": learned.bits_per_byte(w, train_slice, WINDOW, max_windows=SLICE_WINDOWS),
    }
    texts = [row[:-1].tolist() for row in learned.windows(val, WINDOW)][:max_windows]
    stats = routing_stats(w, texts, progress=False)
    fig["balance_val"] = [{"layer": int(r["layer"]), "max_over_mean": r["max/mean"], "dead": r["dead"], "cv": r["cv"],
                           "mi_bits": r["mi_bits"]} for r in stats.table()]
    fig["expert_loads_val"] = stats.counts.tolist()
    fig["expert_loads_val_slice"] = routing_stats(w, texts[:SLICE_WINDOWS], progress=False).counts.tolist()
    fig["measure_seconds"] = time.time() - t0
    return fig


def file_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".safetensors", ".json") and p.name != "model_card.json"
               and p.name != "train_log.json")


def write_card(checkpoint, fig: dict) -> None:
    from kimi_explore.analysis import learned

    path = Path(checkpoint)
    log = json.loads((path / "train_log.json").read_text())
    tc = log["text_config"]
    la = tc["linear_attn_config"]
    card = {
        "name": path.name,
        "corpus": "Python's pydoc_data.topics",
        "corpus_file": learned.CORPUS.name,
        "corpus_python": learned.CORPUS_PYTHON,
        "corpus_sha256": hashlib.sha256(learned.pydoc_corpus()).hexdigest(),
        "params": log["params"],
        "checkpoint_bytes": file_bytes(path),
        "train_seconds": log["train_seconds"],
        "steps": log["steps"],
        "seed": log["args"]["seed"],
        "best_step": log["best"]["step"],
        "window": WINDOW,
        "slice_windows": SLICE_WINDOWS,
        "trainer_val_bits_per_byte": log["best"]["val_bpb"],
        "final_float_val_bits_per_byte": log["final"]["val_bpb_float"],
        "final_exported_val_bits_per_byte": log["final"]["val_bpb_exported"],
        **fig,
    }
    (path / "model_card.json").write_text(json.dumps(card, indent=1) + "\n")
    bal = fig["balance_val"]
    epochs = log["steps"] * log["args"]["batch"] * log["args"]["seq"] / log["train_bytes"]
    rows = "\n".join(f"| {b['layer']} | {b['max_over_mean']:.2f} | {b['dead']} | {b['cv']:.2f} | {b['mi_bits']:.3f} |"
                     for b in bal)
    kda = la["kda_layers"]
    text = f"""# {path.name}: a tiny Kimi K3 trained on Python's documentation

The default model of `kimi_explore` (`ke.tiny_checkpoint()`, shipped inside the package): the Kimi
K3 architecture at toy scale, trained on the text of Python's own `pydoc_data.topics`, in the released checkpoint layout
(`kimi_k3` config shell, `language_model.` names, BF16 matrices, F32 small vectors, MXFP4 routed
experts in the compressed-tensors packing, a sharded index), loaded by the same `from_pretrained`
as the real model. Every figure below was decoded by `kimi_explore` from these files
(`python -m training.make_card`), never computed on the trainer's float weights.

## Quality (bits per byte, measured through `kimi_explore` on this checkpoint)

| split | bits/byte |
|---|---|
| validation (the held-out last 5%, {log['val_bytes']:,} bytes) | **{fig['val_bits_per_byte']:.3f}** |
| train (its last {log['val_bytes']:,} bytes) | {fig['train_bits_per_byte']:.3f} |
| validation, first {SLICE_WINDOWS} windows (recomputed by the tests) | {fig['val_slice_bits_per_byte']:.4f} |
| train, first {SLICE_WINDOWS} windows of that slice (recomputed by the tests) | {fig['train_slice_bits_per_byte']:.4f} |

For scale: uniform is 8.0, a byte-unigram model about 4.5, the random-weight tiny model 10.9.
Windows of {WINDOW} bytes, each decoded from a fresh state, every byte after the first predicted.

Quantisation: at the end of training the float model scored {log['final']['val_bpb_float']:.3f} and its
export (BF16 matrices, MXFP4 experts) {log['final']['val_bpb_exported']:.3f} bits/byte on the validation
split (the experts trained through fake MXFP4 in the final decay phase). The trainer kept the
exported model of step {log['best']['step']} (validation {log['best']['val_bpb']:.3f} bits/byte in the trainer).

## Routing balance on the validation split

Tokens per expert over the whole validation split; a dead expert is never selected.
MI is the mutual information between the input byte's class (letter, space, digit, punctuation,
newline, other) and the top-1 expert, in bits.

| MoE layer | max/mean load | dead experts | CV | MI (bits) |
|---|---|---|---|---|
{rows}

## Size and training

- {log['params']:,} parameters; {card['checkpoint_bytes'] / 1e6:.2f} MB on disk (shards, index, config).
- {log['steps']} steps of {log['args']['batch']} x {log['args']['seq']} bytes ({epochs:.1f} passes over the training
  split), {log['train_seconds'] / 60:.1f} minutes on one CPU thread of a shared 2-core machine, torch {log['torch']}.
- AdamW (lr {log['args']['lr']}, betas 0.9/0.95, weight decay {log['args']['weight_decay']} on matrices), warmup
  {log['args']['warmup']} steps, constant, then a cosine decay to 10% over the last {log['args']['decay_steps']} steps, which
  also train the experts through fake MXFP4 quantisation; dropout {log['args']['dropout']} on the embedding and every
  sublayer output; gradient clipping 1.0; evaluation of the exported rounding every {log['args']['eval_every']} steps,
  keeping the best on validation.
- Router bias: auxiliary-loss-free balancing (DeepSeek-V3): after every step each expert's selection
  bias moves by {log['args']['bias_rate']} against the sign of (its load - the mean load).
- `train_log.json` holds the train and validation bits/byte every {log['args']['eval_every']} steps (and the running
  training loss every 10); `loss_curve.png` plots them.

## Config

hidden {tc['hidden_size']}, {tc['num_hidden_layers']} layers: KDA layers (1-based) {kda}, MLA layers
{la['full_attn_layers']} (K3's 3:1 pattern, the last layer MLA); layer 0 dense (SiTU MLP, width
{tc['intermediate_size']}), layers 1-{tc['num_hidden_layers'] - 1} latent MoE: {tc['num_experts']} routed experts,
top-{tc['num_experts_per_token']}, {tc['num_shared_experts']} shared expert, latent width {tc['routed_expert_hidden_size']},
expert width {tc['moe_intermediate_size']},
sigmoid router with selection-only bias, routed_scaling_factor {tc['routed_scaling_factor']}; KDA {la['num_heads']} heads x
{la['head_dim']} (short conv {la['short_conv_kernel_size']}, lower-bounded gate {la['gate_lower_bound']}); gated NoPE MLA
{tc['num_attention_heads']} heads (q_lora {tc['q_lora_rank']}, kv_lora {tc['kv_lora_rank']}, nope {tc['qk_nope_head_dim']} + rope
{tc['qk_rope_head_dim']}, v {tc['v_head_dim']}); SiTU beta {tc['activation_situ_beta']} / {tc['activation_situ_linear_beta']};
block attention residuals with block size {tc['attn_res_block_size']} (sealed blocks at layers
{[i for i in range(tc['num_hidden_layers']) if i % tc['attn_res_block_size'] == 0]}, plus the output mix); byte vocabulary 256
(`ke.ByteTokenizer`).

## Corpus and licence

Only the text of `pydoc_data.topics` (the values of its `topics` dict joined in sorted key order,
UTF-8; {log['train_bytes'] + log['val_bytes']:,} bytes from CPython {learned.CORPUS_PYTHON}, shipped beside the weights as
`corpus.txt.gz`: each CPython release has its own topics). The last 5% is the
validation split and was never trained on. That text is part of the Python documentation,
Copyright (c) Python Software Foundation, under the PSF License Agreement
(https://docs.python.org/3/license.html); the model is derived from it.

## Rebuild

    pip install -e ".[train]"          # torch (a CPU wheel is enough) and tqdm
    python -m training.train_tiny --out kimi_explore/data/{path.name} --steps {log['steps']} --seed {log['args']['seed']}
    python -m training.parity --checkpoint kimi_explore/data/{path.name} --npz tests/data/trained_tiny_logits.npz
    python -m training.make_card --checkpoint kimi_explore/data/{path.name}

The shipped run used `--time-budget {log['args'].get('time_budget')}` (minutes), which picked {log['steps']} steps on that
machine; `--steps {log['steps']}` replays the same schedule. A rerun with the same seed, torch version
and thread count ({log['threads']}) reproduces the weights; another thread count or CPU changes the last bits of
reductions, and training amplifies them (a different but equally good model).
"""
    (path / "README.md").write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--max-windows", type=int, default=None, help="a dry run on the first windows only")
    args = p.parse_args(argv)
    fig = measure(args.checkpoint, args.max_windows)
    write_card(args.checkpoint, fig)
    print(json.dumps({k: v for k, v in fig.items() if k != "expert_loads_val"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
