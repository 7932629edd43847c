"""Streaming parsers for DeepSeek-V4 output text: reasoning / content / DSML tool calls.

Source: reference/dsv4-architecture.md section 6 ("Parsing output", upstream
``parse_message_from_completion_text``). Fed text deltas (e.g. from
``engine.detokenizer.IncrementalDetokenizer``), they return ``Delta`` objects.

Streaming guarantee: the concatenated output is identical however the text is split into
deltas (one piece, char by char, a marker cut anywhere such as ``</th`` + ``ink>``). Only the
shortest suffix that could still be the start of a marker is held back; a partial marker is
never emitted. Each decision is taken only when later text cannot change it, and ``finish()``
decides the rest as if the text ended there.

EOS: ``<｜end▁of▁sentence｜>`` in the text (detokenised with ``skip_special_tokens=False``) ends
the output; anything after it is ignored. Text without EOS is treated as ending at ``finish()``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from engine.chat import DSML, THINK_END, THINK_START, TOOL_CALLS_START
from engine.tokenizer import EOS_TOKEN

_INVOKE = f"<{DSML}invoke"
_INVOKE_END = f"</{DSML}invoke"
_PARAM = f"<{DSML}parameter"
_PARAM_END = f"/{DSML}parameter"   # upstream reads a value up to here; the value then ends with "<"
_CALLS_END = f"</{DSML}tool_calls>"
_NAME_RE = re.compile(r'\s*name="([^"]+)">\n\n?')    # "\n\n": an invoke without parameters
_PARAM_RE = re.compile(r' name="([^"]+)" string="(true|false)">(.*)<', re.DOTALL)


class DSMLError(ValueError):
    """Malformed DSML tool-call block (raised only with ``fallback_to_content=False``)."""


@dataclass
class Delta:
    """What one ``feed`` / ``finish`` produced: text pieces and the tool calls completed now.

    ``tool_calls`` items are OpenAI format: ``{"id", "type": "function", "function": {"name",
    "arguments": "<JSON object string>"}}``.
    """
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __add__(self, other: Delta) -> Delta:
        return Delta(self.reasoning_content + other.reasoning_content, self.content + other.content,
                     self.tool_calls + other.tool_calls)

    def __bool__(self) -> bool:
        return bool(self.reasoning_content or self.content or self.tool_calls)


def _scan(buf: str, markers: tuple[str, ...], final: bool) -> tuple[int, str | None]:
    """Find the first marker in ``buf`` that no later text can pre-empt.

    Returns ``(n, marker)``: the marker starts at ``n``; or ``(n, None)``: no marker yet,
    ``buf[:n]`` is safe to emit and ``buf[n:]`` (a proper prefix of a marker) must be held back.
    With ``final`` nothing is held back.
    """
    pos, found = len(buf), None
    for m in markers:
        i = buf.find(m)
        if i != -1 and i < pos:
            pos, found = i, m
    if final:
        return pos, found
    longest = max(len(m) for m in markers)
    for start in range(max(0, len(buf) - longest + 1), min(pos, len(buf))):
        tail = buf[start:]
        if any(len(m) > len(tail) and m.startswith(tail) for m in markers):
            return start, None     # a marker may start here: it would come first
    return pos, found


def _expect(buf: str, options: tuple[str, ...], final: bool) -> str | None:
    """The option ``buf`` starts with; "" if ``buf`` may still become one (needs more text);
    None if it cannot (format error)."""
    for opt in options:
        if buf.startswith(opt):
            return opt
    if not final and any(opt.startswith(buf) for opt in options):
        return ""
    return None


class ReasoningParser:
    """Split output into reasoning_content and content (§6).

    ``thinking=True``: the prompt ended with ``<think>``, so output starts inside the reasoning;
    a leading ``<think>`` emitted by the model itself is dropped; everything up to ``</think>`` is
    reasoning, the rest content. Without ``</think>`` (e.g. cut by max_tokens) everything is
    reasoning. ``thinking=False`` (chat mode; the prompt ended with ``</think>``): everything is
    content, verbatim. EOS ends the output in both modes.
    """

    def __init__(self, thinking: bool):
        self._buf = ""
        self._state = "start" if thinking else "content"

    def feed(self, delta: str) -> Delta:
        """Consume a text delta; return what is now certain."""
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> Delta:
        """End of output: flush everything held back."""
        return self._run(final=True)

    def _run(self, final: bool) -> Delta:
        out = Delta()
        while self._buf and self._state != "done":
            if self._state == "start":
                opt = _expect(self._buf, (THINK_START,), final)
                if opt == "":
                    break
                self._buf = self._buf[len(opt or ""):]
                self._state = "reasoning"
                continue
            markers = (THINK_END, EOS_TOKEN) if self._state == "reasoning" else (EOS_TOKEN,)
            n, marker = _scan(self._buf, markers, final)
            if self._state == "reasoning":
                out.reasoning_content += self._buf[:n]
            else:
                out.content += self._buf[:n]
            if marker is None:
                self._buf = self._buf[n:]
                break
            self._buf = self._buf[n + len(marker):]
            self._state = "content" if marker == THINK_END else "done"
        if self._state == "done":
            self._buf = ""
        return out


class ToolCallParser:
    """Split content into plain content and DSML tool calls (§6, parsed as strictly as upstream).

    Content runs up to ``\\n\\n<｜DSML｜tool_calls``; then ``>\\n``, invokes separated by ``\\n``,
    ``</｜DSML｜tool_calls>``, and nothing but EOS after it. Invoke: ``<｜DSML｜invoke name="N">\\n``,
    parameters ``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`` separated by
    ``\\n``, then ``\\n</｜DSML｜invoke>``. ``string="true"`` values become JSON strings, the others
    must be valid JSON and are inserted raw; duplicate parameter names are an error. Each call is
    emitted as soon as its ``</｜DSML｜invoke>`` arrives, with id ``f"{id_prefix}{index}"``.

    Malformed DSML (also: a block unfinished at ``finish()``, or text after the block): with
    ``fallback_to_content=True`` (default, like vLLM) the block text not yet turned into tool
    calls -- the whole block from ``\\n\\n<｜DSML｜tool_calls`` when no call was emitted; nothing of
    a completed block -- is returned as content, ``error`` holds the reason, and the rest of the
    output is content. With False, ``DSMLError`` is raised.
    """

    def __init__(self, id_prefix: str = "call_", fallback_to_content: bool = True):
        self.id_prefix = id_prefix
        self.fallback_to_content = fallback_to_content
        self.error: str | None = None
        self._buf = ""          # text not yet consumed
        self._raw = ""          # consumed block text since the last emitted call (fallback content)
        self._state = "content"  # content | block | done | failed
        self._phase = "open"    # inside the block: open | head | invoke | sep | after
        self._count = 0
        self._searched = 0      # invoke phase: chars already searched for "</｜DSML｜invoke>"

    def feed(self, delta: str) -> Delta:
        """Consume a content delta; return content and the tool calls completed by it."""
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> Delta:
        """End of output: flush held-back text; an unfinished block is an error."""
        return self._run(final=True)

    def _run(self, final: bool) -> Delta:
        out = Delta()
        while self._state != "done":
            if self._state == "block":
                if not self._block_step(out, final):
                    break
                continue
            if not self._buf:
                break
            markers = (TOOL_CALLS_START, EOS_TOKEN) if self._state == "content" else (EOS_TOKEN,)
            n, marker = _scan(self._buf, markers, final)
            out.content += self._buf[:n]
            if marker is None:
                self._buf = self._buf[n:]
                break
            self._buf = self._buf[n + len(marker):]
            if marker == EOS_TOKEN:
                self._state = "done"
            else:
                self._state, self._raw = "block", marker
        if self._state == "done":
            self._buf = ""
        return out

    def _consume(self, n: int) -> None:
        self._raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _fail(self, reason: str) -> None:
        if not self.fallback_to_content:
            raise DSMLError(reason)
        self.error = reason
        self._buf = self._raw + self._buf
        self._raw, self._state = "", "failed"

    def _block_step(self, out: Delta, final: bool) -> bool:
        """Advance one unit inside the tool-call block; False when more text is needed."""
        if self._phase == "invoke":
            res = self._parse_invoke(final)
            if res is None:
                return False
            if isinstance(res, str):
                self._fail(res)
                return True
            name, args, n = res
            out.tool_calls.append({"id": f"{self.id_prefix}{self._count}", "type": "function",
                                   "function": {"name": name, "arguments": args}})
            self._count += 1
            self._buf, self._raw, self._phase = self._buf[n:], "", "sep"
            return True
        if self._phase == "after":
            if not self._buf:
                if final:
                    self._state = "done"
                return final
            opt = _expect(self._buf, (EOS_TOKEN,), final)
            if opt is None:
                self._fail("unexpected text after the tool calls")
            elif opt:
                self._state = "done"
            return bool(opt) or opt is None
        options = {"open": (">\n",), "sep": ("\n",), "head": (_INVOKE, _CALLS_END)}[self._phase]
        opt = _expect(self._buf, options, final)
        if opt == "":
            return False
        if opt is None:
            self._fail(f"expected {' or '.join(map(repr, options))} in the tool-call block")
            return True
        self._consume(len(opt))
        self._phase = {">\n": "head", "\n": "head", _INVOKE: "invoke", _CALLS_END: "after"}[opt]
        self._searched = 0
        if opt == _CALLS_END:
            self._raw = ""      # the block is complete: only later text can still fail
        return True

    def _parse_invoke(self, final: bool) -> tuple[str, str, int] | str | None:
        """Parse one invoke from the buffer (just after ``<｜DSML｜invoke``).

        Returns (name, JSON arguments, chars used through ``</｜DSML｜invoke>``), an error
        message, or None when more text is needed.
        """
        buf = self._buf
        if not final:   # cheap test first: an invoke cannot be complete before its closing tag
            i = buf.find(_INVOKE_END + ">", max(0, self._searched - len(_INVOKE_END)))
            self._searched = len(buf)
            if i == -1:
                return None
        n, stop = _scan(buf, (_PARAM, _INVOKE_END), final)
        if stop is None:
            return "unterminated invoke" if final else None
        m = _NAME_RE.fullmatch(buf[:n])
        if not m:
            return f"bad invoke header {buf[:n]!r}"
        name, pos, args = m.group(1), n + len(stop), {}
        while stop == _PARAM:
            n, end = _scan(buf[pos:], (_PARAM_END,), final)
            if end is None:
                return "unterminated parameter" if final else None
            pm = _PARAM_RE.fullmatch(buf[pos:pos + n])
            if not pm:
                return f"bad parameter {buf[pos:pos + n]!r} in invoke {name!r}"
            key, is_str, value = pm.groups()
            if key in args:
                return f"duplicate parameter {key!r} in invoke {name!r}"
            if is_str == "true":
                value = json.dumps(value, ensure_ascii=False)
            else:
                try:
                    json.loads(value)
                except ValueError:
                    return f"parameter {key!r} of invoke {name!r}: value is not valid JSON"
            args[key] = value
            pos += n + len(end)
            stop = _expect(buf[pos:], (">\n" + _PARAM, ">\n" + _INVOKE_END), final)
            if stop == "":
                return None
            if stop is None:
                return f"expected a parameter or the end of invoke {name!r}"
            pos += len(stop)
            stop = stop[2:]
        close = _expect(buf[pos:], (">",), final)
        if close == "":
            return None
        if close is None:
            return f"expected '>' closing invoke {name!r}"
        arguments = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in args.items()) + "}"
        return name, arguments, pos + 1


class OutputParser:
    """ReasoningParser followed (if ``tools_enabled``) by ToolCallParser on the content.

    ``tool_call_error``: the ToolCallParser's error (None if none / tools disabled).
    """

    def __init__(self, thinking: bool, tools_enabled: bool, id_prefix: str = "call_",
                 fallback_to_content: bool = True):
        self._reasoning = ReasoningParser(thinking)
        self._tools = ToolCallParser(id_prefix, fallback_to_content) if tools_enabled else None

    @property
    def tool_call_error(self) -> str | None:
        return self._tools.error if self._tools else None

    def feed(self, delta: str) -> Delta:
        """Consume a text delta (see module docstring)."""
        return self._route(self._reasoning.feed(delta), final=False)

    def finish(self) -> Delta:
        """End of output: flush both parsers."""
        return self._route(self._reasoning.finish(), final=True)

    def _route(self, d: Delta, final: bool) -> Delta:
        if self._tools is None:
            return d
        t = self._tools.feed(d.content)
        if final:
            t = t + self._tools.finish()
        return Delta(d.reasoning_content, t.content, t.tool_calls)


def parse_completion(text: str, thinking: bool, tools_enabled: bool, id_prefix: str = "call_",
                     ) -> tuple[str, str, list[dict]]:
    """Parse a whole completion: returns (reasoning_content, content, tool_calls).

    Same result as streaming the text through ``OutputParser``; malformed DSML falls back to
    content (see ``ToolCallParser``).
    """
    p = OutputParser(thinking, tools_enabled, id_prefix)
    d = p.feed(text) + p.finish()
    return d.reasoning_content, d.content, d.tool_calls
