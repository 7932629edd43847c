"""Name the request field behind a conversion error of DeepSeek's format library.

The recipe's messages say what is wrong but often not where: its deserialiser reports
``unknown variant `robot`, expected one of `system`, ...`` without a path, and some semantic errors
name the field only in prose. The gateway's rule is a 400 naming the field, so on the error path
(never on a valid request) ``locate`` finds it:

* a deserialisation error (``ValueError``): each element of the body's lists (``messages``,
  ``input``, ``tools``, ``system``) is converted alone inside a minimal valid body; the first that
  fails to deserialise is the culprit (``messages[2]``), refined to its key when the message names
  one (``missing field `content```, a key whose value is the unknown variant, a key named in the text);
* a conversion error: a quoted path in the message (``'tools[0].function.name'``), else the first
  top-level field the message names.
"""
from __future__ import annotations

import re
from typing import Any

_LISTS = ("messages", "input", "tools", "system")
# top-level fields a message may name, most specific first (tool_choice before tools)
_FIELDS = ("tool_choice", "tools", "response_format", "reasoning_effort", "thinking", "max_tokens",
           "max_output_tokens", "stop_sequences", "stop", "stream_options", "top_logprobs", "logprobs",
           "temperature", "top_p", "frequency_penalty", "presence_penalty", "messages", "input",
           "instructions", "system", "reasoning", "text", "seed", "n")
_QUOTED = re.compile(r"'([A-Za-z_]+(?:\[\d+\]|\.[A-Za-z_]+)*)'")
_ALIASES = {"tool_call": "tool_choice"}         # the recipe's name for a field -> the request's
_SCHEMA_OF = re.compile(r"Invalid schema for function '([^']*)'")
_MISSING = re.compile(r"missing field `([A-Za-z_]+)`")
_VARIANT = re.compile(r"unknown variant `([^`]*)`")


def _minimal(api: str, model: str) -> dict[str, Any]:
    if api == "responses":
        return {"model": model, "input": "x"}
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "x"}]}
    if api == "messages":
        body["max_tokens"] = 1
    return body


def _lacking(item: Any, key: str, path: str = "", depth: int = 0) -> str | None:
    """Path (``.content[0]``) of the dict inside ``item`` that lacks ``key``: the first nested one,
    else ``item`` itself (a missing field is usually in the innermost object that has fields)."""
    if isinstance(item, dict):
        subs = item.items()
    elif isinstance(item, list):
        subs = ((f"[{i}]", v) for i, v in enumerate(item))
    else:
        return None
    if depth <= 8:
        for k, v in subs:
            if isinstance(v, (dict, list)):
                got = _lacking(v, key, path + (k if str(k).startswith("[") else f".{k}"), depth + 1)
                if got is not None:
                    return got
    return path if isinstance(item, dict) and key not in item else None


def _holding(item: Any, value: str, path: str = "", depth: int = 0) -> str | None:
    """Path of the first string ``value`` inside ``item``."""
    if item == value:
        return path
    subs = (item.items() if isinstance(item, dict) else
            ((f"[{i}]", v) for i, v in enumerate(item)) if isinstance(item, list) else ())
    if depth > 8:
        return None
    for k, v in subs:
        got = _holding(v, value, path + (k if str(k).startswith("[") else f".{k}"), depth + 1)
        if got is not None:
            return got
    return None


def _key_of(item: Any, message: str) -> str:
    """The path inside ``item`` that ``message`` is about (``.content[0].text``), or ""."""
    m = _MISSING.search(message)
    if m:
        inner = _lacking(item, m.group(1))
        return f"{inner}.{m.group(1)}" if inner is not None else ""
    m = _VARIANT.search(message)
    if m:
        return _holding(item, m.group(1)) or ""
    if isinstance(item, dict):
        for k in item:
            if re.search(rf"\b{re.escape(str(k))}\b", message):
                return f".{k}"
    return ""


def too_deep(obj: Any, limit: int) -> bool:
    """Whether ``obj`` (parsed JSON) nests lists / dicts more than ``limit`` deep (iterative)."""
    stack = [(obj, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            if d >= limit:
                return True
            stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return False


_NOT_TEXT = frozenset({"image_url", "input_image", "image", "file", "input_file", "document", "input_audio",
                       "audio", "video", "video_url"})


def image_part(body: dict[str, Any]) -> str | None:
    """Path of the first content part that is not text (an image, a file / document, audio) in the
    body's messages / input, tool results included, or None: DeepSeek-V4 is a text model, and the
    recipe's V4 encoding would put placeholder text ("[Unsupported Image]") where it was."""
    def not_text(part: dict) -> bool:          # a "type" of any JSON value: only strings name a kind
        t = part.get("type")
        return isinstance(t, str) and t in _NOT_TEXT

    def walk(parts: Any, path: str) -> str | None:
        for j, p in enumerate(parts if isinstance(parts, list) else ()):
            if not isinstance(p, dict):
                continue
            if not_text(p):
                return f"{path}[{j}]"
            inner = walk(p.get("content"), f"{path}[{j}].content")      # a tool result's own parts
            if inner:
                return inner
        return None
    for f in ("messages", "input"):
        items = body.get(f)
        for i, m in enumerate(items if isinstance(items, list) else ()):
            if isinstance(m, dict):
                found = walk([m] if not_text(m) else m.get("content"),
                             f"{f}[{i}]" if not_text(m) else f"{f}[{i}].content")
                if found:
                    return found.replace(f"{f}[{i}][0]", f"{f}[{i}]")
    return None


def locate(api: str, body: dict[str, Any], message: str, deserialising: bool, convert,
           renamed: dict[str, str] | None = None) -> str | None:
    """The field behind ``message`` (``messages[0].role``, ``tools[1]``, ``tool_choice``), or None.

    Args:
        api: "chat" | "responses" | "messages".
        body: the request body as the recipe received it.
        message: the recipe's error message.
        deserialising: the error came from deserialisation (``ValueError``), not a semantic check.
        convert: ``convert(body)`` runs the recipe's conversion of a body, raising as it does.
        renamed: the recipe's name for a top-level field -> the body's (``stop`` -> ``stop_sequences``).
    """
    renamed = {**_ALIASES, **(renamed or {})}
    if deserialising:
        model = body.get("model", "")
        for f in _LISTS:
            items = body.get(f)
            if not isinstance(items, list):
                continue
            for i, item in enumerate(items):
                probe = {**_minimal(api, model), f: [item]}
                try:
                    convert(probe)
                except (ValueError, TypeError, OverflowError):      # this element alone does not deserialise
                    return f"{f}[{i}]" + _key_of(item, message)
                except Exception:                     # a semantic error of the lone element: not its shape
                    continue
        for f, v in body.items():                     # a scalar / object field that does not deserialise
            if f in _LISTS or f == "model":
                continue
            try:
                convert({**_minimal(api, model), f: v})
            except (ValueError, TypeError, OverflowError):
                return f + _key_of(v, message)
            except Exception:
                continue
        inner = _key_of(body, message)
        if inner:
            return inner.lstrip(".")
    m = _SCHEMA_OF.search(message)
    if m:
        for i, t in enumerate(body.get("tools") or ()):
            fn = t.get("function", t) if isinstance(t, dict) else {}
            if isinstance(fn, dict) and fn.get("name") == m.group(1):
                return f"tools[{i}].function.parameters" if "function" in t else f"tools[{i}].parameters"
    m = _QUOTED.search(message)
    if m:
        head = re.match(r"[A-Za-z_]+", m.group(1)).group(0)
        name = renamed.get(head, head) + m.group(1)[len(head):]
        if renamed.get(head, head) in body:
            return name
    for f in _FIELDS:
        if f in body and re.search(rf"\b{f}\b", message, re.IGNORECASE):
            return f
    return None
