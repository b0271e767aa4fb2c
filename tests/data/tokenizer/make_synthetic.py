"""Write a small synthetic tokenizer in the released K3 format (`python make_synthetic.py [outdir]`).

Files, as in `moonshotai/Kimi-K3`:
- `tiktoken.model`: `<base64 bytes> <rank>` lines. Ranks 0..255 are the single bytes in GPT-2 byte
  order (so `!`=0, `"`=1, `.`=13, NUL=188, space=220, as in the real file), then every prefix of
  each word in WORDS (length >= 2, first occurrence wins) in order: merge chains BPE can walk.
- `tokenizer_config.json`: `added_tokens_decoder` naming 16 of the 256 special ids at the same
  offsets from the first special id as the release (163584 + k -> n + k).
- `config.json`: the model's `vocab_size` (n + 256) and `bos_token_id` / `eos_token_id` as released.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

# Offsets from the first special id (163584 in the release) and their names, from the release.
NAMED_SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
    6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>",
    19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 65: "<osagent_mode>",
    254: "[UNK]", 255: "[PAD]",
}

# Pieces the tests need as whole tokens (the doc's examples and chat pieces), and some
# neighbours joined, so a wrong pre-token split would change the ids.
WORDS = [
    "hello", "Hello", "World", "HelloWorld", " world", "漢字", "テスト", "漢字テスト", "你好", "世界",
    "123", "45", "1234", "12345", " it's", "it's", "'s", "line", "\r\n", "1\r\n", "\r\nline",
    "  ", "   ", "    ", " b", "    b",
    "message", " role", '="', '="$', "system", '"', "user", "assistant", "think", "response",
    "You", " are", " a", " helpful", " assistant", "Hi", "no", " thinking", " word", "word", "ab",
    "<|", "|>", "caf", "é", " über",
]


def gpt2_byte_order() -> list[int]:
    """The byte of rank r: GPT-2's printable bytes first, then the rest in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    return printable + [b for b in range(256) if b not in printable]


def synthetic_ranks(words=WORDS) -> dict[bytes, int]:
    ranks = {bytes([b]): r for r, b in enumerate(gpt2_byte_order())}
    for word in words:
        raw = word.encode("utf-8")
        for k in range(2, len(raw) + 1):
            ranks.setdefault(raw[:k], len(ranks))
    return ranks


def write(out: Path, words=WORDS) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    ranks = synthetic_ranks(words)
    n = len(ranks)
    lines = [f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in ranks.items()]
    (out / "tiktoken.model").write_text("".join(lines))
    decoder = {str(n + k): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": name not in ("<|open|>", "<|close|>", "<|sep|>")}
               for k, name in NAMED_SPECIAL_OFFSETS.items()}
    tok_config = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]",
                  "pad_token": "[PAD]", "unk_token": "[UNK]", "tokenizer_class": "TikTokenTokenizer"}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    config = {"bos_token_id": n, "eos_token_id": n + 2, "pad_token_id": n + 255,
              "text_config": {"vocab_size": n + 256}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


if __name__ == "__main__":
    print(write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "synthetic_k3"))
