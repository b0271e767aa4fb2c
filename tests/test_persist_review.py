"""Review of what is read and written to disk (tokenizer files, chat prompts, engine dumps, tiny checkpoints): each
test names the input that was accepted silently, or refused with an error that named the wrong thing."""

from __future__ import annotations

import base64
import importlib.util
import itertools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import kimi_explore as ke
from kimi_explore.chat_template import render_chat
from kimi_explore.tokenizer import RELEASE_VOCAB_SHA256, ByteTokenizer, KimiTokenizer, TokenizerError
from kimi_explore.weights.tiny_model import _tensors, make_text_config, save_checkpoint

needs_tiktoken = pytest.mark.skipif(importlib.util.find_spec("tiktoken") is None, reason="tiktoken not installed")

SYNTH_DIR = Path(__file__).parent / "data" / "tokenizer" / "synthetic_k3"


def _synthetic_copy(tmp_path: Path, vocab: bytes) -> Path:
    """The synthetic tokenizer's directory with its tiktoken.model replaced by `vocab`."""
    out = tmp_path / "tok"
    shutil.copytree(SYNTH_DIR, out)
    (out / "tiktoken.model").write_bytes(vocab)
    return out


# ---- tokenizer: a file of the release's size but not its bytes ----

@needs_tiktoken
def test_a_vocab_with_the_release_rank_count_but_another_sha256_is_refused(tmp_path):
    """A tiktoken.model with the released file's 163,584 ranks but other bytes (one token edited, a damaged download)
    loaded silently and gave other ids. No release file is here, so a well-formed file of that size is built: every
    byte, then byte pairs, then byte triples; its specials named as the release names its first three."""
    n = 163_584
    tokens = [bytes([b]) for b in range(256)]
    tokens += [bytes([a, b]) for a in range(256) for b in range(256)]
    tokens += itertools.islice((bytes([a, b, c]) for a in range(256) for b in range(256) for c in range(256)),
                               n - len(tokens))
    (tmp_path / "tiktoken.model").write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    names = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|end_of_msg|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        str(i): {"content": name, "special": True} for i, name in names.items()}}))
    vocab = tmp_path / "tiktoken.model"
    with pytest.raises(TokenizerError, match=re.escape(str(vocab)) + r": 163,584 ranks, the released file's count, "
                       r"but sha256 [0-9a-f]{64}; the released file's is " + RELEASE_VOCAB_SHA256):
        KimiTokenizer.from_pretrained(tmp_path)


@needs_tiktoken
def test_a_vocab_of_another_size_is_not_held_to_the_release_hash():
    tok = KimiTokenizer.from_pretrained(SYNTH_DIR)
    assert tok.num_base_tokens == 422 and not tok.is_release_vocab


# ---- tokenizer: truncated files, and arguments of the wrong type ----

@needs_tiktoken
def test_a_vocab_cut_inside_its_last_line_says_where_and_that_it_may_be_truncated(tmp_path):
    """The error read "ranks must be exactly 0..421 (they are the token ids)": neither which rank nor that the file
    was cut (its last line `IMO8YmVy 421` became `IMO8YmVy 4`)."""
    raw = (SYNTH_DIR / "tiktoken.model").read_bytes()
    out = _synthetic_copy(tmp_path, raw[:-3])
    with pytest.raises(TokenizerError, match=re.escape(str(out / "tiktoken.model")) + r": ranks must be exactly "
                       r"0..421 .*missing \[421\], repeated \[4\]; its last line \(422\) has rank 4: is the file "
                       r"truncated"):
        KimiTokenizer.from_pretrained(out)


@needs_tiktoken
def test_a_vocab_cut_between_lines_names_the_count_the_config_needs(tmp_path):
    """Cut after 300 whole lines the ranks are consistent; the error blamed the two files for not belonging together
    without saying the vocabulary was short of what tokenizer_config.json's special ids need."""
    lines = (SYNTH_DIR / "tiktoken.model").read_bytes().split(b"\n")
    out = _synthetic_copy(tmp_path, b"\n".join(lines[:300]) + b"\n")
    with pytest.raises(TokenizerError, match=re.escape(str(out / "tokenizer_config.json")) + r": .*ids up to 677 need "
                       r"at least 422 ranks, and " + re.escape(str(out / "tiktoken.model")) + r" has 300 \(its last "
                       r"rank is 299\); is tiktoken.model truncated"):
        KimiTokenizer.from_pretrained(out)


@pytest.mark.parametrize("kind", ["bytes", "kimi"])
@pytest.mark.parametrize("text, found", [(b"hello", "bytes"), (None, "NoneType")])
def test_encode_refuses_what_is_not_text(kind, text, found):
    """ByteTokenizer raised AttributeError ('bytes' object has no attribute 'encode'), KimiTokenizer tiktoken's own
    TypeError: neither said a str was expected."""
    if kind == "kimi":
        pytest.importorskip("tiktoken")
    tok = ByteTokenizer() if kind == "bytes" else KimiTokenizer.from_pretrained(SYNTH_DIR)
    with pytest.raises(TypeError, match=rf"encode: expected a str, found {found}"):
        tok.encode(text)


@needs_tiktoken
def test_is_special_refuses_a_float_as_decode_does():
    """is_special(422.9) was int(422.9) == 422, [BOS]: True for an id that is no token."""
    tok = KimiTokenizer.from_pretrained(SYNTH_DIR)
    with pytest.raises(TokenizerError, match=r"ids: expected integers, found \[422.9\] \(float\)"):
        tok.is_special(422.9)
    assert tok.is_special(np.int64(422)) and not tok.is_special(421)


# ---- chat template ----

@pytest.mark.parametrize("messages, kw, match", [
    ([{"role": "user", "content": 0}], {}, r"messages\[0\]\.content: expected a string or a list of text parts, "
                                           r"found 0"),
    ([{"role": "user", "content": False}], {}, r"messages\[0\]\.content: .* found False"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": 5}], {},
     r"messages\[1\]\.reasoning_content: expected a string .* found 5"),
    ([{"role": "assistant", "content": "a", "reasoning": ["x"]}], {"thinking": False},
     r"messages\[0\]\.reasoning: expected a string .* found \['x'\]"),
    ([{"role": "user", "content": "q"}], {"thinking": False, "thinking_effort": "medium"},
     r"thinking_effort: expected 'low', 'high', 'max' or None, found 'medium'"),
    ({"role": "user", "content": "q"}, {}, r"messages: expected a list of message dicts, found a dict"),
    ([{"role": "user", "content": "q", "name": 0}], {}, r"messages\[0\]\.name: expected a string, found 0"),
])
def test_render_chat_refuses_what_it_used_to_drop_or_misreport(messages, kw, match):
    """0 / False content rendered as empty, a non-str reasoning raised AttributeError, a bad thinking_effort passed
    when thinking=False, a dict was read as its keys ("messages[0] ... found 'role'"), name=0 was dropped."""
    with pytest.raises(ValueError, match=match):
        render_chat(messages, **kw)


def test_render_chat_still_takes_no_content_and_an_empty_name_as_empty():
    a = render_chat([{"role": "user", "content": None}], add_generation_prompt=False)
    assert a == render_chat([{"role": "user", "name": ""}], add_generation_prompt=False)
    assert a == '<|open|>message role="user"<|sep|><|close|>message<|sep|><|end_of_msg|>'


# ---- engine dumps ----

def test_write_dump_to_a_directory_names_the_directory(tmp_path):
    """IsADirectoryError named the temporary file ('.dumps.<pid>.tmp' -> 'dumps')."""
    (tmp_path / "dumps").mkdir()
    with pytest.raises(IsADirectoryError, match=re.escape(str(tmp_path / "dumps")) + " is a directory; give a file "
                       "path") as e:
        ke.write_dump(tmp_path / "dumps", {"logits": np.zeros((2, 3), np.float32)}, tokens=[1, 2])
    assert ".tmp" not in str(e.value)
    assert list(tmp_path.iterdir()) == [tmp_path / "dumps"]


def test_write_dump_refuses_tokens_that_are_not_one_dimensional(tmp_path):
    """tokens=[[1, 2], [3, 4]] was flattened to 4 ids, and 4 rows per array passed."""
    with pytest.raises(ValueError, match=r"write_dump: tokens have shape \(2, 2\); expected a 1-D sequence"):
        ke.write_dump(tmp_path / "d.safetensors", {"logits": np.zeros((4, 3), np.float32)}, tokens=[[1, 2], [3, 4]])
    assert not (tmp_path / "d.safetensors").exists()


@pytest.mark.parametrize("array, dtype", [(np.zeros((2, 3), np.complex128), "complex128"),
                                          (np.zeros((2, 3), np.complex64), "complex64"),
                                          (np.array([[1.0], [None]], dtype=object), "object")])
def test_write_dump_refuses_arrays_that_are_no_activations_by_name(tmp_path, array, dtype):
    """complex128 and object arrays failed with safetensors' bare 'Unknown dtype' (no key); complex64 was written."""
    with pytest.raises(ValueError, match=rf"write_dump: 'layers.0.attn.in' is {dtype}; expected a float array"):
        ke.write_dump(tmp_path / "d.safetensors", {"logits": np.zeros((2, 3), np.float32), "layers.0.attn.in": array},
                      tokens=[1, 2])
    assert not (tmp_path / "d.safetensors").exists()


# ---- tiny checkpoints ----

SMALL = make_text_config(num_hidden_layers=2, linear_attn_config={
    **make_text_config()["linear_attn_config"], "kda_layers": [1], "full_attn_layers": [2]})


@pytest.fixture(scope="module")
def small_tensors():
    return _tensors(SMALL, 0, "bf16")


@pytest.mark.parametrize("shards", [0, -2, True, 1.0])
def test_save_checkpoint_refuses_a_shard_count_that_is_not_a_positive_int(tmp_path, small_tensors, shards):
    with pytest.raises(ValueError, match=re.escape(f"save_checkpoint: shards={shards!r}; expected a positive int")):
        save_checkpoint(tmp_path / "ck", SMALL, small_tensors, shards=shards)
    assert not (tmp_path / "ck").exists()


def test_save_checkpoint_refuses_several_shards_without_an_index(tmp_path, small_tensors):
    """index=False with shards=2 wrote the index anyway."""
    with pytest.raises(ValueError, match=r"save_checkpoint: index=False with shards=2; .* model.safetensors.index.json"):
        save_checkpoint(tmp_path / "ck", SMALL, small_tensors, shards=2, index=False)
    assert not (tmp_path / "ck").exists()
    save_checkpoint(tmp_path / "one", SMALL, small_tensors, shards=1, index=False)  # one file, no index: still written
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["config.json", "model.safetensors"]


def test_save_checkpoint_over_a_regular_file_names_it(tmp_path, small_tensors):
    """A bare FileExistsError from mkdir ("[Errno 17] File exists")."""
    (tmp_path / "ck").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match=re.escape(f"save_checkpoint: {tmp_path / 'ck'} is a file; expected a "
                                                        "checkpoint directory")):
        save_checkpoint(tmp_path / "ck", SMALL, small_tensors)
    assert (tmp_path / "ck").read_text() == "not a checkpoint"
