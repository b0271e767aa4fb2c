"""The release's chat prompt (chat_template.py): the texts the release's renderer printed for these
messages, assistant history, escaping, and what it refuses. The ids it printed: test_tokenizer.py."""

from __future__ import annotations

import pytest

from kimi_explore.chat_template import chat_segments, render_chat

SYSTEM_USER = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi!"}]
EFFORT_MAX_TEXT = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think in your '
    "thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and "
    "`max`.\nNow the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>"
)
SYSTEM_USER_TEXT = (
    '<|open|>message role="system"<|sep|>You are a helpful assistant.<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="user"<|sep|>Hi!<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
)


def test_render_chat_matches_release_text():
    assert render_chat(SYSTEM_USER, thinking_effort="max") == EFFORT_MAX_TEXT + SYSTEM_USER_TEXT
    assert render_chat(SYSTEM_USER) == SYSTEM_USER_TEXT
    assert render_chat([{"role": "user", "content": "no thinking"}], thinking=False) == (
        '<|open|>message role="user"<|sep|>no thinking<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')


def test_render_chat_assistant_history_and_escaping():
    msgs = [{"role": "user", "content": "q", "name": 'a"b&c'},
            {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "2"}],
             "reasoning": "  "}]
    text = render_chat(msgs, add_generation_prompt=False)
    assert text == (
        '<|open|>message role="user" name="a&quot;b&amp;c"<|sep|>q<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>R1<|close|>think<|sep|>'
        "<|open|>response<|sep|>A1<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
        "<|open|>response<|sep|>A2<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")
    assert "think" not in render_chat(msgs, thinking=False)
    assert all(isinstance(t, str) and t for t, _ in chat_segments(msgs))


@pytest.mark.parametrize("kwargs, msgs, match", [
    ({"thinking_effort": "medium"}, SYSTEM_USER, "thinking_effort"),
    ({}, [{"role": "tool", "content": "18C"}], r"messages\[0\]"),
    ({}, [{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}], "tool"),
    ({}, [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "text parts"),
    # these failed with a bare TypeError / KeyError naming no message, or (text None) dropped the part silently
    ({}, [{"role": "user", "content": 5}], r"messages\[0\]\.content: expected a string or a list of text parts"),
    ({}, [{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\.content: only text parts"),
    ({}, [{"role": "user", "content": [{"type": "text", "text": None}]}], r"messages\[0\]\.content: only text parts"),
], ids=["medium_effort", "tool_role", "tool_calls", "image_part", "int_content", "part_without_text", "text_none"])
def test_render_chat_refuses_what_it_does_not_render(kwargs, msgs, match):
    with pytest.raises(ValueError, match=match):
        render_chat(msgs, **kwargs)


# Texts printed by the release's `apply_chat_template` (so thinking_effort="max" unless given), from the
# first-party fixtures in lablup/mlxcel tests/fixtures/kimi_k3/xtml/<case>.json (k3-tokenizer.md, source MLX).
_GEN = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
_HISTORY = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4; answer plainly."},
            {"role": "user", "content": "And 3+3?"}]
_Q = '<|open|>message role="user"<|sep|>What is 2+2?<|close|>message<|sep|><|end_of_msg|>'
_Q2 = '<|open|>message role="user"<|sep|>And 3+3?<|close|>message<|sep|><|end_of_msg|>'
MLX_CASES = {
    "multi_turn_history": (_HISTORY, {}, EFFORT_MAX_TEXT + _Q + (
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>2+2 is 4; answer plainly.<|close|>think<|sep|>'
        "<|open|>response<|sep|>4<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>") + _Q2 + _GEN),
    # apply_chat_template's effort="max" default is dropped when thinking=False
    "multi_turn_history_non_thinking": (_HISTORY, {"thinking": False}, _Q + (
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>4<|close|>response<|sep|>'
        "<|close|>message<|sep|><|end_of_msg|>") + _Q2 + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'),
    "system_and_user_with_names": (
        [{"role": "system", "content": "  You are terse.  ", "name": "policy"},
         {"role": "user", "content": "Who are you?", "name": "alice"}], {},
        EFFORT_MAX_TEXT + '<|open|>message role="system" name="policy"<|sep|>  You are terse.  <|close|>message<|sep|>'
        '<|end_of_msg|><|open|>message role="user" name="alice"<|sep|>Who are you?<|close|>message<|sep|><|end_of_msg|>'
        + _GEN),
    "content_parts_text_only": (
        [{"role": "user", "content": [{"type": "text", "text": "first part "}, {"type": "text", "text": "second part"}]}],
        {}, EFFORT_MAX_TEXT + '<|open|>message role="user"<|sep|>first part second part<|close|>message<|sep|>'
        "<|end_of_msg|>" + _GEN),
    "no_generation_prompt": (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "greeting"}],
        {"add_generation_prompt": False}, EFFORT_MAX_TEXT + '<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|>'
        '<|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>greeting<|close|>think<|sep|>'
        "<|open|>response<|sep|>Hello!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"),
    "thinking_effort_low": ([{"role": "user", "content": "Quick question."}], {"thinking_effort": "low"},
                            EFFORT_MAX_TEXT.replace("=max`", "=low`")
                            + '<|open|>message role="user"<|sep|>Quick question.<|close|>message<|sep|><|end_of_msg|>'
                            + _GEN),
}


@pytest.mark.parametrize("case", MLX_CASES)
def test_render_chat_matches_release_fixtures(case):
    msgs, kwargs, text = MLX_CASES[case]
    assert render_chat(msgs, **{"thinking_effort": "max", **kwargs}) == text
