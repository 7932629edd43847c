"""DeepSeek-V4 chat encoding: OpenAI-style messages -> prompt string.

Source of truth: reference/dsv4-architecture.md section 6, which describes upstream
``encoding/encoding_dsv4.py`` of the deepseek-ai DeepSeek-V4 HF repo rule by rule. The fixed
texts (``TOOLS_TEMPLATE``, ``REASONING_EFFORT_MAX``, ``RESPONSE_FORMAT_TEMPLATE``) are byte-exact
copies of the constants of that file.

Tokenisation of the special strings with the real DeepSeek-V4 ``tokenizer.json``:

* single tokens: BOS (0) and EOS (1) -- the only ones flagged ``special`` (dropped by
  ``skip_special_tokens``); ``<｜User｜>`` 128803, ``<｜Assistant｜>`` 128804, ``<think>`` 128821,
  ``</think>`` 128822, ``｜DSML｜`` 128825, ``<｜latest_reminder｜>`` 128828, ``<｜action｜>`` 128829,
  ``<｜query｜>`` 128830, ``<｜authority｜>`` 128831, ``<｜domain｜>`` 128832, ``<｜title｜>`` 128836,
  ``<｜read_url｜>`` 128845 (added tokens, not "special": they survive ``skip_special_tokens``);
* several tokens: the DSML tags (``<`` + ``｜DSML｜`` + ``invoke`` ...), ``<tool_result>``.

Public API: ``encode_messages``, ``apply_chat_template``, ``prompt_token_ids``, ``ChatError``.
Every bad input raises ``ChatError`` whose message starts with the offending field, e.g.
``messages[2].role: unknown role 'robot'``.
"""
from __future__ import annotations

import copy
import json
from typing import Any

from engine.tokenizer import BOS_TOKEN, EOS_TOKEN

# --- special strings (§6) ---------------------------------------------------------------------
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
# Where an assistant turn's tool-call block starts (the parser splits content here).
TOOL_CALLS_START = f"\n\n<{DSML}tool_calls"

# --- fixed texts, byte-exact from upstream encoding_dsv4.py -----------------------------------
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
RESPONSE_FORMAT_TEMPLATE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml_token}tool_calls>" block like the following:

<{dsml_token}tool_calls>
<{dsml_token}invoke name="$TOOL_NAME">
<{dsml_token}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml_token}parameter>
...
</{dsml_token}invoke>
<{dsml_token}invoke name="$TOOL_NAME2">
...
</{dsml_token}invoke>
</{dsml_token}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {thinking_start_token}), you MUST output your complete reasoning inside {thinking_start_token}...{thinking_end_token} BEFORE any tool calls or final response.

Otherwise, output directly after {thinking_end_token} with tool calls or final response.

### Available Tool Schemas

{tool_schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")
# apply_chat_template: OpenAI reasoning_effort -> encode_messages value ("none" selects chat mode)
_OPENAI_EFFORT = {"minimal": "high", "low": "high", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}


class ChatError(ValueError):
    """A malformed chat request; the message names the field (``messages[1].content: ...``)."""


# --- JSON helpers ------------------------------------------------------------------------------
def to_json(value: Any, field: str = "value") -> str:
    """``json.dumps(value, ensure_ascii=False)`` (upstream ``to_json``); ChatError if not serialisable."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        try:
            return json.dumps(value, ensure_ascii=True)
        except (TypeError, ValueError) as e:
            raise ChatError(f"{field}: not JSON-serialisable ({e})") from None


def render_tools(functions: list[dict]) -> str:
    """The Tools section for a list of function schemas (one ``to_json`` line each)."""
    schemas = "\n".join(to_json(f, "tools") for f in functions)
    return TOOLS_TEMPLATE.format(tool_schemas=schemas, dsml_token=DSML,
                                 thinking_start_token=THINK_START, thinking_end_token=THINK_END)


def render_tool_calls(tool_calls: list[dict]) -> str:
    """``\\n\\n<｜DSML｜tool_calls>...`` for normalised calls ``{"name", "arguments": dict}`` (§6 rule 5)."""
    invokes = []
    for tc in tool_calls:
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f'{v if isinstance(v, str) else to_json(v)}</{DSML}parameter>'
            for k, v in tc["arguments"].items())
        invokes.append(f'<{DSML}invoke name="{tc["name"]}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


# --- validation / normalisation of OpenAI-format input -----------------------------------------
def _text(content: Any, field: str, required: bool) -> str | None:
    """OpenAI content (str, None, or list of text parts) -> str | None; parts are joined with "\\n"."""
    if content is None:
        if required:
            raise ChatError(f"{field}: required")
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise ChatError(f"{field}[{j}]: must be an object, got {type(part).__name__}")
            if part.get("type") != "text":
                raise ChatError(f"{field}[{j}].type: unsupported content part type {part.get('type')!r} "
                                f"(only 'text')")
            if not isinstance(part.get("text"), str):
                raise ChatError(f"{field}[{j}].text: must be a string")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ChatError(f"{field}: must be a string, null or a list of text parts, got {type(content).__name__}")


def _functions(tools: Any, field: str) -> list[dict]:
    """OpenAI ``tools`` (``[{"type": "function", "function": {...}}]``) -> list of function schemas."""
    if not isinstance(tools, list):
        raise ChatError(f"{field}: must be a list")
    out = []
    for j, tool in enumerate(tools):
        f = f"{field}[{j}]"
        if not isinstance(tool, dict):
            raise ChatError(f"{f}: must be an object")
        if tool.get("type", "function") != "function":
            raise ChatError(f"{f}.type: must be 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ChatError(f"{f}.function: must be an object")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatError(f"{f}.function.name: must be a non-empty string")
        to_json(fn, f"{f}.function")
        out.append(fn)
    return out


def _tool_calls(calls: Any, field: str) -> list[dict]:
    """OpenAI assistant ``tool_calls`` -> ``[{"id", "name", "arguments": dict}]``."""
    if not isinstance(calls, list):
        raise ChatError(f"{field}: must be a list")
    out = []
    for j, tc in enumerate(calls):
        f = f"{field}[{j}]"
        if not isinstance(tc, dict):
            raise ChatError(f"{f}: must be an object")
        if tc.get("type", "function") != "function":
            raise ChatError(f"{f}.type: must be 'function', got {tc.get('type')!r}")
        tc_id = tc.get("id", "")
        if tc_id is None:
            tc_id = ""
        if not isinstance(tc_id, str):
            raise ChatError(f"{f}.id: must be a string")
        fn = tc.get("function")
        if not isinstance(fn, dict):
            raise ChatError(f"{f}.function: must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatError(f"{f}.function.name: must be a non-empty string")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise ChatError(f"{f}.function.arguments: not valid JSON") from None
        if not isinstance(args, dict):
            raise ChatError(f"{f}.function.arguments: must be a JSON object")
        to_json(args, f"{f}.function.arguments")
        out.append({"id": tc_id, "name": name, "arguments": args})
    return out


def _normalize(messages: Any, field: str, allow_empty: bool = False) -> list[dict]:
    """Validate ``messages`` and return copies with plain-string content and normalised tool calls."""
    if not isinstance(messages, list) or (not messages and not allow_empty):
        raise ChatError(f"{field}: must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        f = f"{field}[{i}]"
        if not isinstance(msg, dict):
            raise ChatError(f"{f}: must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ChatError(f"{f}.role: missing" if role is None else f"{f}.role: unknown role {role!r}")
        m: dict[str, Any] = {"role": role}
        required = role in ("user", "developer", "tool", "latest_reminder")
        m["content"] = _text(msg.get("content"), f"{f}.content", required)
        if role == "developer" and not m["content"]:
            raise ChatError(f"{f}.content: must be non-empty for role 'developer'")
        if role == "assistant":
            rc = msg.get("reasoning_content", msg.get("reasoning"))
            if rc is not None and not isinstance(rc, str):
                raise ChatError(f"{f}.reasoning_content: must be a string")
            m["reasoning_content"] = rc
            if msg.get("tool_calls") is not None:
                m["tool_calls"] = _tool_calls(msg["tool_calls"], f"{f}.tool_calls")
        if role == "tool":
            tcid = msg.get("tool_call_id", "")
            if not isinstance(tcid, str):
                raise ChatError(f"{f}.tool_call_id: must be a string")
            m["tool_call_id"] = tcid
        if msg.get("tools") is not None:
            m["tools"] = _functions(msg["tools"], f"{f}.tools")
        if msg.get("response_format") is not None:
            if not isinstance(msg["response_format"], dict):
                raise ChatError(f"{f}.response_format: must be an object")
            to_json(msg["response_format"], f"{f}.response_format")
            m["response_format"] = msg["response_format"]
        task = msg.get("task")
        if task is not None and (not isinstance(task, str) or task not in TASK_TOKENS):
            raise ChatError(f"{f}.task: unknown task {task!r} (one of {sorted(TASK_TOKENS)})")
        if task is not None:
            m["task"] = task
        if not isinstance(msg.get("wo_eos", False), bool):
            raise ChatError(f"{f}.wo_eos: must be a boolean")
        if msg.get("wo_eos"):
            m["wo_eos"] = True
        out.append(m)
    return out


# --- §6 rule 1: preprocessing ------------------------------------------------------------------
def merge_tool_messages(messages: list[dict]) -> list[dict]:
    """``tool`` messages -> ``user`` messages with ``tool_result`` content_blocks (upstream rules).

    A tool result joins the previous user message when that one already has content_blocks
    (every user message gets a text block), so consecutive tool results -- and a user message
    right after them (unless the previous one has a task) -- end up in one user turn.
    """
    merged: list[dict] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        if msg["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""), "content": msg["content"]}
            if merged and merged[-1]["role"] == "user" and "content_blocks" in merged[-1]:
                merged[-1]["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif msg["role"] == "user":
            block = {"type": "text", "text": msg["content"]}
            prev = merged[-1] if merged else None
            if prev and prev["role"] == "user" and "content_blocks" in prev and prev.get("task") is None:
                prev["content_blocks"].append(block)
            else:
                new = {"role": "user", "content": msg["content"], "content_blocks": [block]}
                for key in ("task", "wo_eos"):
                    if key in msg:
                        new[key] = msg[key]
                merged.append(new)
        else:
            merged.append(msg)
    return merged


def sort_tool_results_by_call_order(messages: list[dict]) -> list[dict]:
    """Reorder each user turn's tool_result blocks by the preceding assistant's tool_calls ids (in place)."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            order = {tc["id"]: j for j, tc in enumerate(msg["tool_calls"]) if tc["id"]}
        elif msg["role"] == "user" and msg.get("content_blocks"):
            results = [b for b in msg["content_blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                results.sort(key=lambda b: order.get(b["tool_use_id"], 0))
                it = iter(results)
                msg["content_blocks"] = [next(it) if b["type"] == "tool_result" else b
                                         for b in msg["content_blocks"]]
    return messages


def _last_user_index(messages: list[dict]) -> int:
    """Index of the last user/developer message, -1 if none."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] in ("user", "developer"):
            return i
    return -1


def _drop_thinking(messages: list[dict]) -> list[dict]:
    """§6 rule 4: before the last user/developer turn, assistants lose reasoning, developers go."""
    last = _last_user_index(messages)
    out = []
    for i, msg in enumerate(messages):
        if msg["role"] in ("user", "system", "latest_reminder") or i >= last:
            out.append(msg)
        elif msg["role"] == "assistant":
            out.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return out


# --- §6 rules 5-7: rendering -------------------------------------------------------------------
def _render(index: int, msgs: list[dict], thinking: bool, drop_thinking: bool,
            reasoning_effort: str | None, add_generation_prompt: bool) -> str:
    """One message plus its transition (upstream ``render_message``)."""
    msg, role = msgs[index], msgs[index]["role"]
    last_user = _last_user_index(msgs)
    out = REASONING_EFFORT_MAX if index == 0 and thinking and reasoning_effort == "max" else ""
    extras = ""
    if msg.get("tools"):
        extras += "\n\n" + render_tools(msg["tools"])
    if msg.get("response_format"):
        extras += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=to_json(msg["response_format"]))

    if role == "system":
        out += (msg["content"] or "") + extras
    elif role == "developer":
        out += USER_TOKEN + msg["content"] + extras
    elif role == "user":
        parts = []
        for b in msg.get("content_blocks") or [{"type": "text", "text": msg["content"] or ""}]:
            parts.append(b["text"] if b["type"] == "text" else f"<tool_result>{b['content']}</tool_result>")
        out += USER_TOKEN + "\n\n".join(parts)
    elif role == "latest_reminder":
        out += LATEST_REMINDER_TOKEN + msg["content"]
    else:  # assistant
        reasoning = ""
        prev_task = index > 0 and msgs[index - 1].get("task") is not None
        if thinking and not prev_task and (not drop_thinking or index > last_user):
            reasoning = (msg.get("reasoning_content") or "") + THINK_END
        calls = render_tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else ""
        out += reasoning + (msg["content"] or "") + calls + ("" if msg.get("wo_eos") else EOS_TOKEN)

    # §6 rule 6: the transition only before an assistant / latest_reminder, or after the last message
    if index + 1 < len(msgs) and msgs[index + 1]["role"] not in ("assistant", "latest_reminder"):
        return out
    if index + 1 == len(msgs) and not add_generation_prompt:
        return out
    task = msg.get("task")
    if task is not None:
        if task == "action":
            out += ASSISTANT_TOKEN + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task]
        else:
            out += TASK_TOKENS[task]
    elif role in ("user", "developer"):
        open_think = thinking and (not drop_thinking or index >= last_user)
        out += ASSISTANT_TOKEN + (THINK_START if open_think else THINK_END)
    return out


def _attach(messages: list[dict], tools: list[dict] | None, response_format: dict | None) -> list[dict]:
    """Request-level tools / response_format go on the leading system/developer message (replacing
    its own), or on a new leading ``{"role": "system"}`` message when there is none."""
    if not tools and response_format is None:
        return messages
    if messages and messages[0]["role"] in ("system", "developer"):
        head = messages[0]
    else:
        head = {"role": "system", "content": None}
        messages = [head, *messages]
    if tools:
        head["tools"] = tools
    if response_format is not None:
        head["response_format"] = response_format
    return messages


def encode_messages(messages: list[dict], thinking_mode: str = "chat", drop_thinking: bool = True,
                    reasoning_effort: str | None = None, tools: list[dict] | None = None,
                    response_format: dict | None = None, add_generation_prompt: bool = True,
                    context: list[dict] | None = None, add_default_bos_token: bool = True) -> str:
    """Render a conversation into the DeepSeek-V4 prompt string (reference §6, ``encode_messages``).

    Args:
        messages: OpenAI-style messages, roles system / developer / user / assistant / tool /
            latest_reminder. ``content``: str, None or a list of ``{"type": "text", "text"}`` parts
            (joined with "\\n"). Assistant: optional ``reasoning_content`` (alias ``reasoning``) and
            OpenAI ``tool_calls`` (``arguments`` a JSON-object string or an object), ``wo_eos``.
            Tool: ``tool_call_id`` + content. System/developer: optional ``tools`` (OpenAI format)
            and ``response_format``. Any message: optional ``task`` (action, query, authority,
            domain, title, read_url).
        thinking_mode: "chat" or "thinking".
        drop_thinking: drop earlier reasoning / developer turns in thinking mode (forced off
            when any message carries tools).
        reasoning_effort: None, "high" (adds nothing) or "max" (prepends ``REASONING_EFFORT_MAX``
            in thinking mode).
        tools / response_format: request-level additions, put on the leading system/developer
            message (a new empty system message is inserted when there is none).
        add_generation_prompt: False omits the transition after the last message
            (``<｜Assistant｜><think>`` etc.); True is upstream behaviour.
        context: already-rendered earlier messages: they inform the rules but are not rendered,
            and no BOS is added.
        add_default_bos_token: prepend BOS when there is no context.

    Returns:
        The prompt text, BOS included (tokenise it with ``prompt_token_ids``).

    Raises:
        ChatError: malformed messages or options; the message names the field.
    """
    if thinking_mode not in THINKING_MODES:
        raise ChatError(f"thinking_mode: must be 'chat' or 'thinking', got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ChatError(f"reasoning_effort: must be None, 'high' or 'max', got {reasoning_effort!r}")
    if not isinstance(drop_thinking, bool):
        raise ChatError("drop_thinking: must be a boolean")
    msgs = _normalize(messages, "messages")
    ctx = _normalize(context, "context", allow_empty=True) if context else []
    fn_tools = _functions(tools, "tools") if tools else None
    if response_format is not None and not isinstance(response_format, dict):
        raise ChatError("response_format: must be an object")
    msgs = _attach(msgs, fn_tools, response_format)

    # rule 1: preprocess (sorting sees the context's last tool calls, as upstream)
    msgs = sort_tool_results_by_call_order(ctx + merge_tool_messages(msgs))[len(ctx):]
    ctx = sort_tool_results_by_call_order(merge_tool_messages(ctx))
    full = ctx + msgs
    prompt = BOS_TOKEN if add_default_bos_token and not ctx else ""          # rule 2
    drop = drop_thinking and not any(m.get("tools") for m in full)           # rule 3
    thinking = thinking_mode == "thinking"
    if thinking and drop:                                                    # rule 4
        full = _drop_thinking(full)
        start = len(_drop_thinking(ctx))
    else:
        start = len(ctx)
    for i in range(start, len(full)):
        prompt += _render(i, full, thinking, drop, reasoning_effort, add_generation_prompt)
    return prompt


def apply_chat_template(messages: list[dict], tools: list[dict] | None = None, thinking: bool | None = None,
                        reasoning_effort: str | None = None, drop_thinking: bool = True,
                        response_format: dict | None = None, add_generation_prompt: bool = True) -> str:
    """The vLLM DeepSeek-V4 tokenizer wrapper's ``apply_chat_template`` (§6), as text.

    ``thinking`` None means off (chat mode). ``reasoning_effort`` (OpenAI values): "none" selects
    chat mode; "xhigh" / "max" -> "max"; "minimal" / "low" / "medium" / "high" -> "high" (adds
    nothing); None -> None. ``tools`` (OpenAI format) go on the leading system/developer message or
    a new leading system message.

    Raises:
        ChatError: unknown reasoning_effort, non-boolean thinking, or anything ``encode_messages`` rejects.
    """
    if thinking is not None and not isinstance(thinking, bool):
        raise ChatError(f"thinking: must be a boolean, got {thinking!r}")
    mode = "thinking" if thinking else "chat"
    if reasoning_effort is None:
        effort = None
    elif reasoning_effort == "none":
        mode, effort = "chat", None
    elif isinstance(reasoning_effort, str) and reasoning_effort in _OPENAI_EFFORT:
        effort = _OPENAI_EFFORT[reasoning_effort]
    else:
        raise ChatError(f"reasoning_effort: unknown value {reasoning_effort!r} "
                        f"(one of none, {', '.join(_OPENAI_EFFORT)})")
    try:
        return encode_messages(messages, thinking_mode=mode, drop_thinking=drop_thinking, reasoning_effort=effort,
                               tools=tools, response_format=response_format,
                               add_generation_prompt=add_generation_prompt)
    except RecursionError:           # absurdly nested JSON in arguments / schemas
        raise ChatError("messages: JSON nested too deeply") from None


def prompt_token_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered prompt, with NO extra BOS (the text already starts with BOS).

    ``tokenizer``: ``engine.tokenizer.Tokenizer``. Special strings in ``text`` map to their ids.
    Guards against the double-BOS mistake of tokenising with ``add_special_tokens=True``.
    """
    return tokenizer.encode(text, add_bos=False)
