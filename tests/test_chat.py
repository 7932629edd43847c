"""engine.chat: one test per rule of reference §6 with exact prompt strings, plus bad input."""
from __future__ import annotations

import json

import pytest

from engine.chat import (REASONING_EFFORT_MAX, ChatError, apply_chat_template, encode_messages,
                         prompt_token_ids)
from engine.tokenizer import Tokenizer

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A, LR = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
T0, T1 = "<think>", "</think>"

WEATHER_CALL = {"id": "call_w", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}
WEATHER_DSML = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS_SECTION = (
    '\n\n## Tools\n\nYou have access to a set of tools to help answer the user\'s question. You can invoke tools '
    'by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    '...\n</｜DSML｜invoke>\n<｜DSML｜invoke name="$TOOL_NAME2">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\n'
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    'If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside '
    '<think>...</think> BEFORE any tool calls or final response.\n\n'
    'Otherwise, output directly after </think> with tool calls or final response.\n\n'
    '### Available Tool Schemas\n\n'
    '{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}}}\n\n'
    'You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n')


def sys_(c):
    return {"role": "system", "content": c}


def user(c, **kw):
    return {"role": "user", "content": c, **kw}


def asst(c, **kw):
    return {"role": "assistant", "content": c, **kw}


# --- §6 examples, verbatim -----------------------------------------------------------------------
def test_example_chat():
    assert encode_messages([sys_("You are helpful."), user("Hi")]) == f"{B}You are helpful.{U}Hi{A}{T1}"


def test_example_thinking():
    assert encode_messages([sys_("You are helpful."), user("Hi")], "thinking") == f"{B}You are helpful.{U}Hi{A}{T0}"


def test_example_multi_turn_thinking_drops_old_reasoning():
    msgs = [user("Q1"), asst("A1", reasoning_content="R1"), user("Q2")]
    assert encode_messages(msgs, "thinking") == f"{B}{U}Q1{A}{T1}A1{E}{U}Q2{A}{T0}"


def test_example_system_developer_user_chat():
    msgs = [sys_("S"), {"role": "developer", "content": "D"}, user("Q")]
    assert encode_messages(msgs) == f"{B}S{U}D{U}Q{A}{T1}"


def test_example_user_then_latest_reminder():
    msgs = [user("Q"), {"role": "latest_reminder", "content": "R"}]
    assert encode_messages(msgs, "thinking") == f"{B}{U}Q{A}{T0}{LR}R"


def test_example_tasks():
    assert encode_messages([user("Q", task="query")], "thinking") == f"{B}{U}Q<｜query｜>"
    assert encode_messages([user("Q", task="action")], "thinking") == f"{B}{U}Q{A}{T0}<｜action｜>"
    assert encode_messages([user("Q", task="action")], "chat") == f"{B}{U}Q{A}{T1}<｜action｜>"
    for task in ("authority", "domain", "title", "read_url"):
        assert encode_messages([user("Q", task=task)]) == f"{B}{U}Q<｜{task}｜>"


def test_example_tool_call_in_history():
    msgs = [user("W"), asst(None, reasoning_content="need tool", tool_calls=[WEATHER_CALL]),
            {"role": "tool", "tool_call_id": "call_w", "content": "sunny"}]
    got = encode_messages(msgs, "thinking", drop_thinking=False)
    assert got == (f"{B}{U}W{A}{T0}need tool{T1}{WEATHER_DSML}{E}{U}<tool_result>sunny</tool_result>{A}{T0}")


# --- rule 1: preprocessing ---------------------------------------------------------------------
def test_tool_results_merged_and_sorted_by_call_order():
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ("a", "b", "c")]
    msgs = [user("Q"), asst("", tool_calls=calls),
            {"role": "tool", "tool_call_id": "c", "content": "C"},
            {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "tool", "tool_call_id": "b", "content": "B"}]
    inv = '<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>'
    dsml = f"\n\n<｜DSML｜tool_calls>\n{inv}\n{inv}\n{inv}\n</｜DSML｜tool_calls>"
    assert encode_messages(msgs) == (
        f"{B}{U}Q{A}{T1}{dsml}{E}{U}<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\n"
        f"<tool_result>C</tool_result>{A}{T1}")


def test_user_text_after_tool_results_joins_the_same_turn():
    msgs = [user("Q"), asst("", tool_calls=[WEATHER_CALL]),
            {"role": "tool", "tool_call_id": "call_w", "content": "sunny"}, user("thanks")]
    assert encode_messages(msgs).endswith(f"{E}{U}<tool_result>sunny</tool_result>\n\nthanks{A}{T1}")


def test_tool_content_as_text_parts():
    msgs = [user("Q"), asst("", tool_calls=[WEATHER_CALL]),
            {"role": "tool", "tool_call_id": "call_w", "content": [{"type": "text", "text": "x"},
                                                                   {"type": "text", "text": "y"}]}]
    assert encode_messages(msgs).endswith(f"{U}<tool_result>x\ny</tool_result>{A}{T1}")


# --- rule 2: BOS / context ---------------------------------------------------------------------
def test_bos_once_and_context_continuation():
    assert encode_messages([user("Q")]).count(B) == 1
    ctx = [user("Q1"), asst("A1")]
    assert encode_messages([user("Q2")], context=ctx) == f"{U}Q2{A}{T1}"
    assert encode_messages([user("Q")], add_default_bos_token=False) == f"{U}Q{A}{T1}"


# --- rules 3 / 4: drop_thinking ---------------------------------------------------------------
def test_drop_thinking_removes_old_reasoning_and_developer():
    msgs = [{"role": "developer", "content": "D"}, user("Q1"), asst("A1", reasoning_content="R1"), user("Q2")]
    assert encode_messages(msgs, "thinking") == f"{B}{U}Q1{A}{T1}A1{E}{U}Q2{A}{T0}"
    # chat mode never drops anything
    assert encode_messages(msgs, "chat") == f"{B}{U}D{U}Q1{A}{T1}A1{E}{U}Q2{A}{T1}"


def test_drop_thinking_off_keeps_reasoning():
    msgs = [user("Q1"), asst("A1", reasoning_content="R1"), user("Q2")]
    assert encode_messages(msgs, "thinking", drop_thinking=False) == f"{B}{U}Q1{A}{T0}R1{T1}A1{E}{U}Q2{A}{T0}"


def test_tools_turn_drop_thinking_off():
    msgs = [{"role": "system", "content": "S", "tools": [TOOL]}, user("Q1"), asst("A1", reasoning_content="R1"),
            user("Q2")]
    assert encode_messages(msgs, "thinking") == f"{B}S{TOOLS_SECTION}{U}Q1{A}{T0}R1{T1}A1{E}{U}Q2{A}{T0}"


def test_assistant_after_last_user_keeps_reasoning_wo_eos():
    msgs = [user("Q"), asst("A", reasoning_content="R", wo_eos=True)]
    assert encode_messages(msgs, "thinking") == f"{B}{U}Q{A}{T0}R{T1}A"
    assert encode_messages([user("Q"), asst("A", reasoning_content="R")], "chat") == f"{B}{U}Q{A}{T1}A{E}"


# --- rule 5: rendering per role ----------------------------------------------------------------
def test_system_tools_section():
    assert encode_messages([{"role": "system", "content": "S", "tools": [TOOL]}, user("Q")]) == (
        f"{B}S{TOOLS_SECTION}{U}Q{A}{T1}")


def test_response_format():
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}
    tail = ("\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
            '{"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}')
    assert encode_messages([sys_("S"), user("Q")], response_format=rf) == f"{B}S{tail}{U}Q{A}{T1}"
    dev = {"role": "developer", "content": "D", "tools": [TOOL], "response_format": rf}
    assert encode_messages([dev, user("Q")]) == f"{B}{U}D{TOOLS_SECTION}{tail}{U}Q{A}{T1}"


def test_latest_reminder_between_turns():
    msgs = [user("Q"), {"role": "latest_reminder", "content": "R"}, asst("A"), user("Q2")]
    assert encode_messages(msgs) == f"{B}{U}Q{A}{T1}{LR}RA{E}{U}Q2{A}{T1}"


def test_assistant_tool_call_values():
    args = {"q": "天气 \"x\"", "n": 1.5, "flag": True, "none": None, "list": [1, "a"], "obj": {"k": "v"}}
    call = {"id": "1", "type": "function", "function": {"name": "search", "arguments": json.dumps(args)}}
    got = encode_messages([user("Q"), asst("ok", tool_calls=[call])])
    p = '<｜DSML｜parameter name="{}" string="{}">{}</｜DSML｜parameter>'
    params = "\n".join([p.format("q", "true", '天气 "x"'), p.format("n", "false", "1.5"),
                        p.format("flag", "false", "true"), p.format("none", "false", "null"),
                        p.format("list", "false", '[1, "a"]'), p.format("obj", "false", '{"k": "v"}')])
    assert got == (f'{B}{U}Q{A}{T1}ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="search">\n{params}\n'
                   f'</｜DSML｜invoke>\n</｜DSML｜tool_calls>{E}')


def test_openai_content_parts_and_none():
    msgs = [sys_([{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}]),
            user([{"type": "text", "text": "Q"}]), asst(None)]
    assert encode_messages(msgs) == f"{B}S1\nS2{U}Q{A}{T1}{E}"


def test_consecutive_user_messages_merge():
    assert encode_messages([user("a"), user("b")]) == f"{B}{U}a\n\nb{A}{T1}"


def test_add_generation_prompt_false():
    assert encode_messages([user("Q")], "thinking", add_generation_prompt=False) == f"{B}{U}Q"


# --- rule 7: reasoning effort ------------------------------------------------------------------
def test_reasoning_effort_max_prefix():
    assert encode_messages([sys_("S"), user("Q")], "thinking", reasoning_effort="max") == (
        f"{B}{REASONING_EFFORT_MAX}S{U}Q{A}{T0}")
    assert REASONING_EFFORT_MAX.startswith("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert REASONING_EFFORT_MAX.endswith("to ensure absolutely no assumption is left unchecked.\n\n")
    assert encode_messages([user("Q")], "chat", reasoning_effort="max") == f"{B}{U}Q{A}{T1}"
    assert encode_messages([user("Q")], "thinking", reasoning_effort="high") == f"{B}{U}Q{A}{T0}"


# --- apply_chat_template (vLLM wrapper) --------------------------------------------------------
def test_apply_chat_template_mapping():
    msgs = [user("Q")]
    assert apply_chat_template(msgs) == f"{B}{U}Q{A}{T1}"
    assert apply_chat_template(msgs, thinking=True) == f"{B}{U}Q{A}{T0}"
    assert apply_chat_template(msgs, thinking=True, reasoning_effort="xhigh") == f"{B}{REASONING_EFFORT_MAX}{U}Q{A}{T0}"
    assert apply_chat_template(msgs, thinking=True, reasoning_effort="max") == f"{B}{REASONING_EFFORT_MAX}{U}Q{A}{T0}"
    assert apply_chat_template(msgs, thinking=True, reasoning_effort="low") == f"{B}{U}Q{A}{T0}"
    assert apply_chat_template(msgs, thinking=True, reasoning_effort="none") == f"{B}{U}Q{A}{T1}"


def test_apply_chat_template_tools_placement():
    # no system message: a leading system message carrying the tools is inserted
    assert apply_chat_template([user("Q")], tools=[TOOL]) == f"{B}{TOOLS_SECTION}{U}Q{A}{T1}"
    # leading system message: tools are attached to it
    assert apply_chat_template([sys_("S"), user("Q")], tools=[TOOL]) == f"{B}S{TOOLS_SECTION}{U}Q{A}{T1}"


# --- tokenisation --------------------------------------------------------------------------------
def test_prompt_token_ids_single_bos(tiny_ckpt):
    tok = Tokenizer(tiny_ckpt("flash", 1))
    ids = prompt_token_ids(tok, encode_messages([user("Hi")], "thinking"))
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids[1] == tok._tok.token_to_id(U) and ids[-2:] == [tok._tok.token_to_id(A), tok._tok.token_to_id(T0)]
    for s in (U, A, LR, T0, T1, "｜DSML｜", "<｜action｜>", "<｜query｜>", "<｜read_url｜>"):
        assert len(tok.encode(s)) == 1, s


# --- bad input ------------------------------------------------------------------------------------
BAD = [
    ([], {}, "messages: must be a non-empty list"),
    ("hi", {}, "messages: must be a non-empty list"),
    ([user("Q"), "x"], {}, "messages[1]: must be an object"),
    ([user("Q"), user("Q"), {"role": "robot", "content": "x"}], {}, "messages[2].role: unknown role 'robot'"),
    ([{"content": "x"}], {}, "messages[0].role: missing"),
    ([{"role": "user"}], {}, "messages[0].content: required"),
    ([user(3)], {}, "messages[0].content: must be a string, null or a list of text parts"),
    ([user([{"type": "image_url", "image_url": {}}])], {}, "messages[0].content[0].type: unsupported"),
    ([user([{"type": "text", "text": 1}])], {}, "messages[0].content[0].text: must be a string"),
    ([user(["x"])], {}, "messages[0].content[0]: must be an object"),
    ([{"role": "developer", "content": ""}], {}, "messages[0].content: must be non-empty"),
    ([{"role": "tool", "tool_call_id": "a"}], {}, "messages[0].content: required"),
    ([{"role": "tool", "tool_call_id": 1, "content": "x"}], {}, "messages[0].tool_call_id: must be a string"),
    ([user("Q"), asst(None, tool_calls={"a": 1})], {}, "messages[1].tool_calls: must be a list"),
    ([user("Q"), asst(None, tool_calls=[{"type": "function", "function": {"name": "f", "arguments": "{x"}}])], {},
     "messages[1].tool_calls[0].function.arguments: not valid JSON"),
    ([user("Q"), asst(None, tool_calls=[{"type": "function", "function": {"name": "f", "arguments": "[1]"}}])], {},
     "messages[1].tool_calls[0].function.arguments: must be a JSON object"),
    ([user("Q"), asst(None, tool_calls=[{"type": "function", "function": {"arguments": "{}"}}])], {},
     "messages[1].tool_calls[0].function.name: must be a non-empty string"),
    ([user("Q"), asst(None, tool_calls=[{"type": "x", "function": {"name": "f", "arguments": "{}"}}])], {},
     "messages[1].tool_calls[0].type: must be 'function'"),
    ([user("Q"), asst(None, tool_calls=["f"])], {}, "messages[1].tool_calls[0]: must be an object"),
    ([user("Q"), asst(None, reasoning_content=5)], {}, "messages[1].reasoning_content: must be a string"),
    ([user("Q", task="x")], {}, "messages[0].task: unknown task 'x'"),
    ([{"role": "system", "content": "S", "tools": [{"type": "function"}]}], {},
     "messages[0].tools[0].function: must be an object"),
    ([{"role": "system", "content": "S", "response_format": "json"}], {},
     "messages[0].response_format: must be an object"),
    ([user("Q")], {"thinking_mode": "deep"}, "thinking_mode: must be 'chat' or 'thinking'"),
    ([user("Q")], {"reasoning_effort": "xhigh"}, "reasoning_effort: must be None, 'high' or 'max'"),
    ([user("Q")], {"tools": [{"type": "function", "function": {"name": ""}}]},
     "tools[0].function.name: must be a non-empty string"),
    ([user("Q")], {"tools": {"name": "f"}}, "tools: must be a list"),
]


@pytest.mark.parametrize("messages,kwargs,msg", BAD)
def test_bad_input(messages, kwargs, msg):
    with pytest.raises(ChatError) as e:
        encode_messages(messages, **kwargs)
    assert str(e.value).startswith(msg), str(e.value)


@pytest.mark.parametrize("kwargs,msg", [({"reasoning_effort": "extreme"}, "reasoning_effort: unknown value"),
                                        ({"thinking": "yes"}, "thinking: must be a boolean")])
def test_bad_apply_chat_template(kwargs, msg):
    with pytest.raises(ChatError) as e:
        apply_chat_template([user("Q")], **kwargs)
    assert str(e.value).startswith(msg), str(e.value)


def test_review_findings_raise_chat_error():
    from engine.chat import ChatError, apply_chat_template
    deep = {"a": None}
    for _ in range(5000):
        deep = {"a": deep}
    cases = [
        dict(messages=[{"role": "user", "content": "q", "task": ["action"]}]),
        dict(messages=[{"role": "user", "content": "q"}], reasoning_effort=["max"]),
        dict(messages=[{"role": "user", "content": "q"},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]}]),
    ]
    for kw in cases:
        with pytest.raises(ChatError):
            apply_chat_template(**kw)
