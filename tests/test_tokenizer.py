"""Tokenizers: the byte tokenizer, and the K3 tiktoken tokenizer on a synthetic vocabulary in the released format.

The real 2.8 MB `tiktoken.model` is not available offline, so the public K3 id vectors cannot be
checked here. Instead the K3 tokenizer is checked against
- an independent naive BPE (the `regex` package running PAT_STR + textbook lowest-rank merging),
- facts read from the release (HF `moonshotai/Kimi-K3` at 9f62e4e9): PAT_STR's text, the piece
  splits it documents, the special-token layout, its chunking loop and the chat ids it printed.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from test_chat_template import SYSTEM_USER

from kimi_explore.chat_template import render_chat
from kimi_explore.model.config import KimiDecoderConfig
from kimi_explore.tokenizer import (
    PAT_STR,
    ByteTokenizer,
    KimiTokenizer,
    TokenizerError,
    load_tokenizer,
    split_for_encoding,
)

needs_tiktoken = pytest.mark.skipif(importlib.util.find_spec("tiktoken") is None, reason="tiktoken not installed")

ROOT = Path(__file__).parent
SYNTH_DIR = ROOT / "data" / "tokenizer" / "synthetic_k3"
_spec = importlib.util.spec_from_file_location("make_synthetic", ROOT / "data" / "tokenizer" / "make_synthetic.py")
make_synthetic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_synthetic)

# The joined pattern (332 characters) as the release's tokenizer code spells it.
RELEASE_PAT_STR = (
    r"""[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}"""
    r"""\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
PIECES = regex.compile(RELEASE_PAT_STR, regex.V1)


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
    pytest.importorskip("tiktoken")
    return KimiTokenizer.from_pretrained(SYNTH_DIR)


@pytest.fixture(scope="module")
def n(tok) -> int:
    """First special id (163584 in the release)."""
    return tok.num_base_tokens


# ---- independent reference: regex pre-tokenization + naive BPE ----

def naive_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Textbook tiktoken BPE: a piece that is a token is that token; else repeatedly merge the
    adjacent pair whose concatenation has the lowest rank (leftmost on ties)."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [bytes([b]) for b in piece]
    while True:
        best = min(((ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                    if parts[i] + parts[i + 1] in ranks), default=None)
        if best is None:
            return [ranks[p] for p in parts]
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


@functools.lru_cache(maxsize=1)
def _synthetic_vocab():
    ranks = make_synthetic.synthetic_ranks()
    n = len(ranks)
    named = make_synthetic.NAMED_SPECIAL_OFFSETS
    return ranks, {named.get(k, f"<|reserved_token_{n + k}|>"): n + k for k in range(256)}


def naive_encode(text: str, allow_special: bool) -> list[int]:
    ranks, specials = _synthetic_vocab()
    chunks = [text]
    if allow_special:
        names = sorted(specials, key=len, reverse=True)
        chunks = re.split("(" + "|".join(map(re.escape, names)) + ")", text)
    ids = []
    for chunk in chunks:
        if allow_special and chunk in specials:
            ids.append(specials[chunk])
        else:
            for piece in PIECES.findall(chunk):
                ids += naive_bpe(piece.encode("utf-8"), ranks)
    return ids


def naive_split(text: str, window: int, max_run: int) -> list[str]:
    """The doc's transcription of the release's `_split_whitespaces_or_nonwhitespaces` loop."""
    pieces = []
    for w in range(0, len(text), window):
        win, start, run, prev = text[w:w + window], 0, 0, None
        for i, ch in enumerate(win):
            sp = ch.isspace()
            run = run + 1 if sp == prev else 1
            prev = sp
            if run > max_run:
                pieces.append(win[start:i])
                start, run = i, 1
        pieces.append(win[start:])
    return pieces


# Characters whose Unicode properties are old and stable (the regex crate and `regex` agree on them).
ALPHABET = list("abcdeHWXYZ xyz019'.,!?-_$\"=<>|[]") + ["\t", "\n", "\r", "\u00a0", "\u3000", "é", "ï", "ü", "Ω", "д",
                                                         "\u0301", "漢", "字", "你", "好", "テ", "ス", "ト", "ア", "😀"]
TEXT = st.text(alphabet=st.sampled_from(ALPHABET), max_size=40)
SPECIAL_SPELLINGS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[BOS]", "[PAD]", "<|not_a_real_token|>"]
TEXT_WITH_SPECIALS = st.lists(st.one_of(TEXT, st.sampled_from(SPECIAL_SPELLINGS)), max_size=6).map("".join)


# ---- PAT_STR ----

def test_pat_str_is_the_release_pattern():
    assert PAT_STR == RELEASE_PAT_STR
    assert len(PAT_STR) == 332


@pytest.mark.parametrize("text, pieces", [
    ("HelloWorld 漢字テスト 12345 it's", ["Hello", "World", " ", "漢字", "テスト", " ", "123", "45", " it's"]),
    ("1234", ["123", "4"]),
    ("a    b", ["a", "   ", " b"]),
    ("line1\r\nline2", ["line", "1", "\r\n", "line", "2"]),
    ("It's THEY'RE we'LL", ["It's", " THEY'RE", " we'LL"]),
    ("你好世界", ["你好世界"]),
    ("abc漢字xyz", ["abc", "漢字", "xyz"]),
], ids=["doc_example", "digits_cap_3", "whitespace_lookahead", "crlf_together", "contractions_any_case",
        "han_run", "han_split_from_latin"])
def test_pre_tokenizer_pieces(text, pieces):
    assert PIECES.findall(text) == pieces


@pytest.mark.parametrize("text", [
    "HelloWorld 漢字テスト 12345 it's", "1234", "1234567890", "a    b", "line1\r\nline2", "hello world",
    "It's Bob's; they're here, we'll see, I'd go, you've won, don't.", "naïve café über", "a\n\n  b\t\tc  ",
])
def test_tiktoken_splits_like_the_regex_reference(tok, text):
    # The synthetic vocabulary holds the documented pieces AND their joins ("12345", "HelloWorld",
    # "1\r\n", "    b"...) as tokens, so a different split inside tiktoken would change the ids.
    assert tok.encode(text) == naive_encode(text, allow_special=True)
    assert tok.encode(text, allow_special=False) == naive_encode(text, allow_special=False)


def test_documented_pieces_are_single_tokens(tok):
    ids = tok.encode("HelloWorld 漢字テスト 12345 it's")
    assert [tok.token_label(i) for i in ids] == ["Hello", "World", " ", "漢字", "テスト", " ", "123", "45", " it's"]


# ---- encode / decode ----

@settings(max_examples=150, deadline=None)
@given(TEXT_WITH_SPECIALS, st.booleans())
def test_encode_matches_naive_bpe_and_round_trips(tok, text, allow_special):
    ids = tok.encode(text, allow_special=allow_special)
    assert ids == naive_encode(text, allow_special)
    assert tok.decode(ids) == text


def test_byte_order_and_merges(tok):
    # GPT-2 byte order as in the real file: "!"=0, '"'=1, "."=13, NUL=188, space=220.
    assert [tok.encode(c)[0] for c in ['!', '"', ".", "\0", " "]] == [0, 1, 13, 188, 220]
    assert tok.encode("hello") == [make_synthetic.synthetic_ranks()[b"hello"]]
    assert tok.encode("hellohello") == naive_encode("hellohello", True)


def test_decode_bytes_exact_across_a_split_character(tok):
    ids = tok.encode("ä")                # not a token: two byte tokens
    assert len(ids) == 2
    assert tok.decode(ids[:1]) == "\ufffd"
    assert tok.decode_bytes(ids[:1]) + tok.decode_bytes(ids[1:]) == "ä".encode()
    assert tok.token_label(ids[0]) == "<0xC3>"


def test_decode_rejects_ids_outside_the_vocabulary(tok):
    with pytest.raises(TokenizerError, match=r"0\.\.677"):
        tok.decode([1, tok.vocab_size])


# ---- specials ----

def test_special_layout(tok, n):
    named = {k: v for k, v in make_synthetic.NAMED_SPECIAL_OFFSETS.items()}
    assert tok.vocab_size == n + 256
    assert len(tok.special_tokens) == 256
    for k in range(256):
        name = named.get(k, f"<|reserved_token_{n + k}|>")
        assert tok.special_id(name) == n + k
        assert tok.token_label(n + k) == name and tok.is_special(n + k)
    assert sum(s.startswith("<|reserved_token_") for s in tok.special_tokens) == 240
    assert not tok.is_special(n - 1)


def test_allow_special_modes(tok, n):
    text = "literal <|open|> and <|end_of_msg|> and [BOS] here"
    trusted = tok.encode(text, allow_special=True)
    assert [i for i in trusted if i >= n] == [n + 3, n + 2, n + 0]
    untrusted = tok.encode(text, allow_special=False)
    assert max(untrusted) < n
    assert tok.decode(untrusted) == text == tok.decode(trusted)


def test_reserved_names_are_tokens_but_pad_slot_is_not(tok, n):
    assert tok.encode(f"<|reserved_token_{n + 8}|>") == [n + 8]
    assert tok.encode(f"<|reserved_token_{n + 253}|>") == [n + 253]
    # n+255 is [PAD], so its reserved spelling is plain text (release: 163839 falls through to BPE).
    pad_spelling = f"<|reserved_token_{n + 255}|>"
    assert max(tok.encode(pad_spelling)) < n
    assert max(tok.encode("<|not_a_real_token|>")) < n
    with pytest.raises(TokenizerError, match="not_a_real_token"):
        tok.special_id("<|not_a_real_token|>")


def test_eos_is_the_stop_token_not_tokenizer_config_eos(tok, n, tmp_path):
    assert tok.eos_id == tok.special_id("<|end_of_msg|>") == n + 2
    assert tok.eos_id != tok.special_id("[EOS]")
    assert tok.bos_id == n
    # Without config.json, the stop token is still <|end_of_msg|>.
    bare = make_synthetic.write(tmp_path / "bare")
    (bare / "config.json").unlink()
    assert KimiTokenizer.from_pretrained(bare).eos_id == n + 2


def test_token_labels(tok):
    assert tok.token_label(tok.encode("\r\n")[0]) == "\\r\\n"
    assert tok.token_label(tok.encode("漢字")[0]) == "漢字"
    assert tok.token_label(tok.encode(" ")[0]) == " "
    assert tok.token_label(tok.encode("\x07")[0]) == "\\x07"
    assert tok.token_label(tok.encode("\\")[0]) == "\\\\"  # else the text \n labels as the newline does


def test_a_text_token_reading_like_a_broken_byte_keeps_its_own_label():
    """A token whose text is `<0xE4>` labelled as the broken byte 0xE4 does: two tokens, one label."""
    from kimi_explore.tokenizer import _label_bytes

    assert _label_bytes(b"\xe4") == "<0xE4>"
    assert _label_bytes(b"<0xE4>") == "\\x3c0xE4>"
    assert _label_bytes(b"a<0xE4>") == "a\\x3c0xE4>"
    assert _label_bytes(b"<0xe4> <0x") == "<0xe4> <0x"  # lower case or unfinished: nothing to confuse


def test_the_byte_tokenizer_replaces_a_lone_surrogate_as_tiktoken_does():
    """ByteTokenizer raised UnicodeEncodeError where KimiTokenizer's tiktoken gives U+FFFD."""
    from kimi_explore import ByteTokenizer

    t = ByteTokenizer()
    assert t.encode("a\ud800b") == list("a\ufffdb".encode())
    assert t.encode("\ud83d\ude00") == list("\U0001f600".encode())  # a pair given as two surrogates joins


# ---- long-input chunking ----

@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab \n\t\u3000漢")), max_size=60),
       st.integers(1, 12), st.integers(1, 6))
def test_split_for_encoding_matches_release_loop(text, window, max_run):
    assert split_for_encoding(text, window, max_run) == naive_split(text, window, max_run)


def test_run_cap_changes_ids(tok):
    # "abd" * 8334 is one 25,002-letter piece; the release cuts it after 25,000 chars, i.e. between
    # "a" and "bd" of the last repeat, so "ab" can no longer merge there: one more id.
    text = "abd" * 8334
    ab, d = tok.encode("ab")[0], tok.encode("d")[0]
    assert tok._enc.encode(text) == [ab, d] * 8334                     # uncut: 16,668 ids
    assert tok.encode(text) == [ab, d] * 8333 + [tok.encode("a")[0]] + tok.encode("b") + [d]
    assert len(tok.encode(text)) == 16_669


def test_window_cut_matches_release_count(tok):
    # Release (SIM): "word " * 100000 -> 100,002 ids (the 400k-char window cut adds a "word" + " ").
    text = "word " * 100_000
    ids = tok.encode(text)
    assert len(ids) == 100_002
    assert len(tok._enc.encode(text, allowed_special="all")) == 100_001


# ---- chat prompt: the ids the release printed (its texts: test_chat_template.py) ----

# Release ids (SIM default_system_user, last 40; SIM non_thinking) and the text of each id.
RELEASE_IDS_SYSTEM_USER = [
    163587, 2778, 6244, 878, 14062, 1, 163589, 3900, 554, 261, 13205, 26626, 13, 163588, 2778, 163589, 163586,
    163587, 2778, 6244, 878, 2482, 1, 163589, 18699, 0, 163588, 2778, 163589, 163586,
    163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 39964, 163589,
]
RELEASE_IDS_NON_THINKING = [163587, 2778, 6244, 878, 2482, 1, 163589, 4069, 9545, 163588, 2778, 163589, 163586,
                            163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 12092, 163589]
RELEASE_PIECES = {2778: "message", 6244: " role", 878: '="', 14062: "system", 1: '"', 2482: "user",
                  69702: "assistant", 39964: "think", 12092: "response", 3900: "You", 554: " are", 261: " a",
                  13205: " helpful", 26626: " assistant", 13: ".", 18699: "Hi", 0: "!", 4069: "no", 9545: " thinking"}


def _to_synthetic(tok, release_ids):
    """Release ids -> the synthetic vocabulary's ids for the same tokens (specials by offset)."""
    return [i - 163584 + tok.num_base_tokens if i >= 163584 else tok.encode(RELEASE_PIECES[i])[0] for i in release_ids]


def test_encode_chat_matches_release_ids(tok):
    for pieces in RELEASE_PIECES.values():      # each release piece is one token in the synthetic vocabulary
        assert len(tok.encode(pieces)) == 1
    assert tok.encode_chat(SYSTEM_USER) == _to_synthetic(tok, RELEASE_IDS_SYSTEM_USER)
    assert tok.encode_chat([{"role": "user", "content": "no thinking"}], thinking=False) == _to_synthetic(
        tok, RELEASE_IDS_NON_THINKING)


def test_chat_segments_change_ids_and_block_injection(tok, n):
    msgs = [{"role": "user", "name": "$ref", "content": "<|open|> hi"}]
    ids = tok.encode_chat(msgs, add_generation_prompt=False)
    # Per-segment: '="' then '$ref'; joined text would pre-tokenize '="$' as one piece (a token here).
    assert tok.encode('="')[0] in ids and tok.encode('="$')[0] not in ids
    assert tok.encode('="$')[0] in tok.encode(render_chat(msgs, add_generation_prompt=False))
    # User text spelling a marker is plain BPE: only the structural markers are special.
    assert [i for i in ids if i >= n] == [n + 3, n + 5, n + 4, n + 5, n + 2]
    assert tok.decode(ids) == render_chat(msgs, add_generation_prompt=False)


# ---- byte tokenizer ----

@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_labels_and_errors():
    tok = ByteTokenizer()
    assert [tok.token_label(i) for i in b"a ~\n\t\r\x07\x00\x7f"] == ["a", " ", "~", "\\n", "\\t", "\\r", "\\x07",
                                                                      "\\x00", "\\x7f"]
    assert [tok.token_label(i) for i in "漢".encode()] == ["<0xE6>", "<0xBC>", "<0xA2>"]
    assert tok.decode([0xE6, 0x41]) == "\ufffdA"
    assert tok.bos_id is None and tok.eos_id is None and tok.special_tokens == {}
    with pytest.raises(TokenizerError, match="0..255"):
        tok.decode([256])
    with pytest.raises(TokenizerError, match="no special tokens"):
        tok.special_id("[BOS]")


# ---- load_tokenizer and file errors ----

@needs_tiktoken
def test_load_tokenizer_picks_by_files_and_vocab():
    assert isinstance(load_tokenizer(SYNTH_DIR), KimiTokenizer)
    assert isinstance(load_tokenizer(SYNTH_DIR / "config.json"), KimiTokenizer)
    tiny = ROOT / "data" / "reference" / "tiny_k3"
    assert isinstance(load_tokenizer(tiny), ByteTokenizer)
    cfg = KimiDecoderConfig.from_file(tiny / "config.json")
    assert isinstance(load_tokenizer(cfg), ByteTokenizer)
    assert isinstance(load_tokenizer({"text_config": {"vocab_size": 256}}), ByteTokenizer)
    assert isinstance(load_tokenizer(SimpleNamespace(config=cfg, source=str(SYNTH_DIR))), KimiTokenizer)
    assert isinstance(load_tokenizer(SimpleNamespace(config=cfg, source="")), ByteTokenizer)


def test_load_tokenizer_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 163840}}))
    with pytest.raises(TokenizerError, match=r"no tiktoken\.model.*vocab_size is 163840"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="not a checkpoint directory"):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(TokenizerError, match="vocab_size is 1000"):
        load_tokenizer({"vocab_size": 1000})
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no config.json"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(TypeError, match="path_or_config"):
        load_tokenizer(3)


@needs_tiktoken
def test_load_tokenizer_refuses_a_vocabulary_larger_than_the_model(tmp_path):
    d = make_synthetic.write(tmp_path / "k3")
    (d / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 300}}))
    with pytest.raises(TokenizerError, match="does not belong"):
        load_tokenizer(d)


@pytest.mark.parametrize("corrupt, match", [
    (lambda d: (d / "tokenizer_config.json").unlink(), "tokenizer_config.json: no such file"),
    (lambda d: (d / "tiktoken.model").write_text("aGk= 0\nnot-base64! 1\n"), r"tiktoken\.model:2: expected"),
    (lambda d: (d / "tiktoken.model").write_text("aGk= 0\naGo= 2\n"), r"ranks must be exactly 0\.\.1"),
    (lambda d: (d / "tiktoken.model").write_text("aGk= 0\naGk= 1\n"), "repeated"),
    (lambda d: (d / "tiktoken.model").write_text("".join((d / "tiktoken.model").read_text().splitlines(True)[:300])),
     "outside"),
], ids=["no_tokenizer_config", "bad_line", "rank_gap", "duplicate_token", "specials_outside_range"])
@needs_tiktoken
def test_malformed_files_are_named(tmp_path, corrupt, match):
    d = make_synthetic.write(tmp_path / "k3")
    corrupt(d)
    with pytest.raises(TokenizerError, match=match):
        KimiTokenizer.from_pretrained(d)


def test_missing_tiktoken_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ImportError, match=r"kimi-explore\[tokenizer\]"):
        KimiTokenizer.from_pretrained(SYNTH_DIR)


def test_committed_synthetic_files_are_the_generator_output(tmp_path):
    fresh = make_synthetic.write(tmp_path / "k3")
    for name in ("tiktoken.model", "tokenizer_config.json", "config.json"):
        assert (fresh / name).read_bytes() == (SYNTH_DIR / name).read_bytes(), name


# ---- adversarial review: files of another model, ids that are not ids ----

# Kimi K2's names in the K3 special slots (k3-tokenizer.md section 3): 163586 <|im_end|>, 163587 <|im_user|>,
# 163588 <|im_assistant|>, 163594 <|im_system|>, 163601 <|im_middle|>; as offsets from the first special id.
K2_NAMES_BY_OFFSET = {2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 10: "<|im_system|>", 17: "<|im_middle|>"}


@needs_tiktoken
def test_encode_chat_refuses_a_vocabulary_without_the_k3_markers(tmp_path):
    # K2 files (same BPE, other special names) load fine for plain text, but the K3 chat markers are not
    # special tokens there: encoding them as BPE would silently feed the model a different prompt.
    d = make_synthetic.write(tmp_path / "k2")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    n = len(make_synthetic.synthetic_ranks())
    for k, name in K2_NAMES_BY_OFFSET.items():
        cfg["added_tokens_decoder"][str(n + k)] = {"content": name, "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = KimiTokenizer.from_pretrained(d)
    assert tok.encode("hello") == [make_synthetic.synthetic_ranks()[b"hello"]]   # plain text is unaffected
    with pytest.raises(TokenizerError, match=r"<\|open\|>.*tokenizer_config\.json"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


@needs_tiktoken
def test_load_tokenizer_refuses_a_vocabulary_smaller_than_the_model(tmp_path):
    # k3-tokenizer.md section 1: the tokenizer's n_vocab IS text_config.vocab_size (163,840); a model with
    # more rows than its tokenizer has ids means the tokenizer files come from another model.
    d = make_synthetic.write(tmp_path / "k3")
    (d / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 163840}}))
    with pytest.raises(TokenizerError, match="163840.*does not belong"):
        load_tokenizer(d)


@pytest.mark.parametrize("bad", [[1.7], [True], ["5"], [np.float64(2.0)], np.array([2.9])],
                         ids=["float", "bool", "str", "np_float", "np_float_array"])
@pytest.mark.parametrize("make", [ByteTokenizer, lambda: KimiTokenizer.from_pretrained(SYNTH_DIR)], ids=["byte", "kimi"])
def test_decode_refuses_ids_that_are_not_integers(make, bad):
    # int(1.7) == 1 would decode a token the caller never had; ids are integers (np.int64 included).
    if make is not ByteTokenizer:
        pytest.importorskip("tiktoken")
    tok = make()
    assert tok.decode(np.array([72, 105], dtype=np.int64)) == tok.decode([72, 105])
    with pytest.raises(TokenizerError, match="ids: expected integers"):
        tok.decode(bad)


@needs_tiktoken
def test_content_parts_are_separate_segments(tok):
    # The release encodes each text part of a list content as its own segment, so BPE cannot merge across
    # parts. First-party ids (MLX xtml/content_parts_text_only.json): ["first part ", "second part"] ->
    # 8531 'first', 1258 ' part', 220 ' ', 8959 'second', 1258 ' part'; joined text would pre-tokenize
    # ' second' as one piece. (vLLM's port of encoding_k3.py: `_render_content` appends part by part.)
    # Here: ["hel", "lo"] is encode("hel") + encode("lo"), not encode("hello").
    parts = [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    whole = [{"role": "user", "content": "hello"}]
    split_ids, whole_ids = (tok.encode_chat(m, add_generation_prompt=False) for m in (parts, whole))
    k = whole_ids.index(tok.encode("hello")[0])
    assert split_ids == whole_ids[:k] + tok.encode("hel") + tok.encode("lo") + whole_ids[k + 1:]
    assert render_chat(parts) == render_chat(whole)


@pytest.mark.parametrize("key", ["eos_token_id", "bos_token_id"])
@pytest.mark.parametrize("value", [5, 10**6], ids=["bpe_token", "outside_vocab"])
@needs_tiktoken
def test_config_stop_and_bos_ids_must_be_specials(tmp_path, key, value):
    # k3-tokenizer.md section 3: config.json bos_token_id 163584 ([BOS]) and eos_token_id 163586
    # (<|end_of_msg|>) are special tokens; another model's ids would silently give a wrong stop token.
    d = make_synthetic.write(tmp_path / "k3")
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match=rf"config\.json: {key} {value} is not a special token"):
        KimiTokenizer.from_pretrained(d)


def _tiktoken_pieces(text: str) -> list[str]:
    """tiktoken's own pre-token split of `text` under PAT_STR: with every byte substring of `text` in the
    vocabulary, BPE merges each piece into one token, so the tokens ARE the pieces."""
    tiktoken = pytest.importorskip("tiktoken")
    raw = text.encode()
    ranks = {bytes([b]): b for b in range(256)}
    for s in sorted({raw[i:j] for i in range(len(raw)) for j in range(i + 2, len(raw) + 1)}, key=lambda s: (len(s), s)):
        ranks.setdefault(s, len(ranks))
    enc = tiktoken.Encoding("pieces", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
    return [enc.decode_single_token_bytes(i).decode() for i in enc.encode_ordinary(text)]


@pytest.mark.parametrize("text", [
    "👨‍👩‍👧 family 🇯🇵 flag ❤️ 1️⃣", "한국어 텍스트 ภาษาไทย", "١٢٣٤٥ ²³ １２３４ Ⅻ ǅungla ʰello", "e\u0301te\u0301 naïve",
    "a\u000b\u000cb\u0085c\u2028d\u3000e", "  \n\n  x\r\n\r\n y", "DON'T don't I'M i'm O'Neil", "x=1;y=22;z=333;w=4444",
    "漢字かなカナ漢字abc漢", "\ufeffbom a\u200bb", "$100.50 €20 ¥3000", "a  \n  b\t\t",
])
def test_tiktoken_pre_tokenizer_matches_the_regex_reference_on_tricky_text(text):
    # Emoji (ZWJ, flags, variation selectors), Hangul/Thai marks, non-ASCII digits, titlecase/modifier
    # letters, exotic whitespace, CRLF runs, contractions in any case, Han next to kana and Latin.
    assert _tiktoken_pieces(text) == PIECES.findall(text)


def _damaged_copy(tmp_path, vocab=None, config=None):
    """The synthetic K3 tokenizer with its vocabulary lines or its tokenizer_config.json changed."""
    d = make_synthetic.write(tmp_path / "damaged")
    if vocab is not None:
        lines = (d / "tiktoken.model").read_bytes().splitlines(keepends=True)
        (d / "tiktoken.model").write_bytes(b"".join(vocab(lines)))
    if config is not None:
        raw = json.loads((d / "tokenizer_config.json").read_text())
        config(raw)
        (d / "tokenizer_config.json").write_text(json.dumps(raw))
    return d


def _rename_rank(lines, rank: int, token: bytes):
    return [base64.b64encode(token) + b" %d\n" % rank if line.split()[1] == b"%d" % rank else line for line in lines]


def test_a_vocabulary_that_cannot_encode_every_byte_is_refused(tmp_path):
    """Byte 'z' renamed 'zz' (the ranks still 0..n-1) loaded, and encode('az') raised tiktoken's Rust panic (not an
    Exception: the CLI printed a traceback); a rank below 256 holding two bytes is no GPT-2 byte table either."""
    z = _damaged_copy(tmp_path / "z", vocab=lambda lines: _rename_rank(lines, 89, b"zz"))  # rank 89 is 'z'
    with pytest.raises(TokenizerError, match=re.escape(str(z / "tiktoken.model")) + r": the first 256 ranks must be the "
                                             r"256 single bytes .*; byte 0x7A has no rank"):
        load_tokenizer(z)
    two = _damaged_copy(tmp_path / "two", vocab=lambda lines: _swap_ranks(lines, 5, 300))
    with pytest.raises(TokenizerError, match=r"tiktoken.model: the first 256 ranks must be the 256 single bytes"):
        load_tokenizer(two)


def _swap_ranks(lines, a: int, b: int):
    swap = {b"%d" % a: b"%d" % b, b"%d" % b: b"%d" % a}
    return [line.split()[0] + b" " + swap[line.split()[1]] + b"\n" if line.split()[1] in swap else line for line in lines]


@pytest.mark.parametrize("content", ["", 5, None])
def test_a_special_token_spelled_as_nothing_is_refused(tmp_path, content):
    """An empty spelling loaded, and encode() with specials never returned (4 GB and counting); a number failed inside
    tiktoken with a TypeError naming no file."""
    d = _damaged_copy(tmp_path, config=lambda raw: next(iter(raw["added_tokens_decoder"].values())).update(content=content))
    with pytest.raises(TokenizerError, match=re.escape(str(d / "tokenizer_config.json")) +
                       r": added_tokens_decoder\[\d+\]\.content is .*, expected a non-empty string"):
        load_tokenizer(d)
