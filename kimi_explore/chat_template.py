"""The release's chat prompt ("XTML", `encoding_k3.py` at 9f62e4e9) for system / user / assistant turns.

    render_chat(messages, thinking=True, add_generation_prompt=True, thinking_effort=None) -> str
    chat_segments(messages, ...) -> [(text, allow_special)]     what KimiTokenizer.encode_chat encodes

A message is `<|open|>message role="user"<|sep|>` + content + `<|close|>message<|sep|><|end_of_msg|>`;
an assistant turn wraps its reasoning in a `think` element and its answer in a `response` element;
the generation prompt opens an assistant message and its `think` (or, thinking=False, `response`).

Traps: the release encodes the prompt segment by segment (each attribute is four segments, each text
part of a list content one), and joining the segments changes ids, so `chat_segments` is the wire
format and `render_chat` only its text. Tools, tool turns and images are refused with a clear error rather than rendered
approximately (argument rendering differs between upstream revisions), and so are unknown roles
(the 9f62e4e9 renderer skips them silently).
"""

from __future__ import annotations

__all__ = ["chat_segments", "render_chat"]

_EFFORT_BODY = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
                "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                "Now the system is invoked with `thinking_effort={}`.")
_UNSUPPORTED_KEYS = ("tool_calls", "tools")


def _open(tag: str, attrs: dict) -> list[tuple[str, bool]]:
    # Each attribute is four text segments (` key`, `="`, value, `"`): the release encodes them
    # separately, and joining them changes ids when a value starts or ends with punctuation.
    segs = [("<|open|>", True), (tag, False)]
    for k, v in attrs.items():
        segs += [(f" {k}", False), ('="', False), (str(v).replace("&", "&amp;").replace('"', "&quot;"), False), ('"', False)]
    return segs + [("<|sep|>", True)]


def _close(tag: str) -> list[tuple[str, bool]]:
    return [("<|close|>", True), (tag, False), ("<|sep|>", True)]


def _message(attrs: dict, body: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    return _open("message", attrs) + body + _close("message") + [("<|end_of_msg|>", True)]


def _content(msg: dict, where: str) -> list[str]:
    """The content's texts, one per segment: each text part of a list is its own segment in the
    release (`_render_content` appends part by part), so BPE never merges across two parts."""
    content = msg.get("content")
    if content is None:  # no content (or None): an empty message
        return [""]
    if isinstance(content, str):
        return [content]
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where}.content: expected a string or a list of text parts, found {content!r}")
    parts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ValueError(f"{where}.content: only text parts {{'type': 'text', 'text': str}} are rendered, found {part!r}")
        parts.append(part["text"])
    return parts


def chat_segments(messages, *, thinking: bool = True, add_generation_prompt: bool = True,
                  thinking_effort: str | None = None) -> list[tuple[str, bool]]:
    """(text, allow_special) segments of the release's chat prompt, in order; empty texts dropped.

    Defaults are `build_chat_segments`'s. Note HF `apply_chat_template` defaults to
    thinking_effort="max" (the effort system message first). Every past assistant turn keeps its
    reasoning when thinking=True; with thinking=False the think channel is dropped everywhere."""
    segs: list[tuple[str, bool]] = []
    if not isinstance(messages, (list, tuple)):  # a dict's keys or a str's characters would be read as the messages
        raise ValueError(f"messages: expected a list of message dicts, found a {type(messages).__name__} "
                         f"{messages!r:.80} (one message? pass [message])")
    # checked with thinking=False too (a typo must not pass until thinking is switched on); "medium" is named in the
    # text but rejected
    if thinking_effort is not None and thinking_effort not in ("low", "high", "max"):
        raise ValueError(f"thinking_effort: expected 'low', 'high', 'max' or None, found {thinking_effort!r}")
    if thinking and thinking_effort is not None:
        body = [(_EFFORT_BODY.format(thinking_effort).strip(), False)]
        segs += _message({"role": "system", "type": "thinking-effort"}, body)
    for n, msg in enumerate(messages):
        where = f"messages[{n}]"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"{where}: expected a dict with role 'system', 'user' or 'assistant' (tool turns are "
                             f"not rendered here), found {msg!r}")
        if any(msg.get(k) for k in _UNSUPPORTED_KEYS):
            raise ValueError(f"{where}: tool declarations and tool calls are not rendered by render_chat")
        if msg.get("name") is not None and not isinstance(msg["name"], str):
            raise ValueError(f"{where}.name: expected a string, found {msg['name']!r}")
        attrs = {"role": role, **({"name": msg["name"]} if msg.get("name") else {})}
        body = [(text, False) for text in _content(msg, where)]
        if role == "assistant":
            for key in ("reasoning_content", "reasoning"):
                if msg.get(key) is not None and not isinstance(msg[key], str):
                    raise ValueError(f"{where}.{key}: expected a string (the assistant's reasoning), found {msg[key]!r:.80}")
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
            think = _open("think", {}) + [(reasoning if reasoning.strip() else "", False)] + _close("think")
            body = (think if thinking else []) + _open("response", {}) + body + _close("response")
        segs += _message(attrs, body)
    if add_generation_prompt:
        segs += _open("message", {"role": "assistant"}) + _open("think" if thinking else "response", {})
    return [(t, s) for t, s in segs if t]


def render_chat(messages, *, thinking: bool = True, add_generation_prompt: bool = True,
                thinking_effort: str | None = None) -> str:
    """The chat prompt as text (see `chat_segments`); encode it with `KimiTokenizer.encode_chat`."""
    return "".join(t for t, _ in chat_segments(messages, thinking=thinking, add_generation_prompt=add_generation_prompt,
                                               thinking_effort=thinking_effort))
