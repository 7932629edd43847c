"""The grammar the gateway builds (``server.gateway.structured``), replayed through a worker's
matcher (``engine.core.grammar``) token by token: which outputs it admits and which it refuses."""
from __future__ import annotations

import pytest

from engine.core.grammar import GrammarBackend
from engine.tokenizer import Tokenizer
from server.gateway.dsformat import DeepSeekFormat
from server.gateway.jobs import sampling_params
from server.gateway.protocol import ApiError
from server.gateway.structured import structural_tag

MODEL = "m"
TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {
    "type": "object", "required": ["tags", "s"], "properties": {
        "tags": {"type": "array", "items": {"type": "string"}}, "s": {"type": "string", "maxLength": 5}}}}},
         {"type": "function", "function": {"name": "t", "parameters": {
             "type": "object", "properties": {"z": {"type": "string", "enum": ["utc", "cet"]}}}}}]


@pytest.fixture(scope="module")
def env(tiny_ckpt):
    ckpt = tiny_ckpt("flash", 1)
    fmt = DeepSeekFormat(ckpt, MODEL, default_thinking=False)
    return fmt, GrammarBackend(ckpt, 129280, (Tokenizer(ckpt).eos_id,)), Tokenizer(ckpt)


def _tag(env, api: str, body: dict):
    fmt = env[0]
    cr, _ = fmt.convert(api, {"model": MODEL, **body})
    return structural_tag(api, cr, body, fmt.starts_in_reasoning(cr), fmt.marker_ids)


def _admits(env, tag: str, *parts) -> bool:
    """Whether the grammar admits ``parts`` in order (text is encoded; an int is a token id)."""
    m = env[1].matcher(tag)
    ids = [t for p in parts for t in ([p] if isinstance(p, int) else env[2].encode(p))]
    return all(m.accept_token(t) for t in ids)


def test_markers_are_tokens_and_never_inside_values(env):
    fmt, _, tok = env
    d = fmt.marker_ids["｜DSML｜"]
    tag, field = _tag(env, "chat", {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                    "tool_choice": "required"})
    assert field == "tools"
    head = ["<", d, 'invoke name="w">\n<', d, 'parameter name="tags" string="false">["a']
    assert _admits(env, tag, *head)
    assert not _admits(env, tag, *head, d)                          # the marker inside a JSON string
    spelled = [tok._tok.token_to_id(p) for p in ("ï½ľ", "DS", "ML", "ï½ľ")]   # "｜DSML｜" in byte-level pieces
    assert not _admits(env, tag, "<", *spelled)
    line = [*head, '"]</', d, 'parameter>\n<', d, 'parameter name="s" string="true">ab']
    assert _admits(env, tag, *line) and not _admits(env, tag, *line, d)       # nor in a raw string
    assert not _admits(env, tag, *line, "cdefg")                    # maxLength 5
    end = [*line, "</", d, "parameter>\n</", d, "invoke>\n"]
    assert _admits(env, tag, *end, "<", d, 'invoke name="t">\n<', d, 'parameter name="z" string="true">cet</', d,
                   "parameter>\n</", d, "invoke>\n</", d, "tool_calls>", tok.eos_id)


def test_parallel_tool_calls_false_allows_one_call(env):
    d = env[0].marker_ids["｜DSML｜"]
    tag, _ = _tag(env, "chat", {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS[1:],
                                "tool_choice": "required", "parallel_tool_calls": False})
    call = ["<", d, 'invoke name="t">\n</', d, "invoke>\n"]
    assert _admits(env, tag, *call, "</", d, "tool_calls>")
    assert not _admits(env, tag, *call, "<", d)


def test_thinking_runs_free_until_the_end_token(env):
    fmt = env[0]
    tag, _ = _tag(env, "chat", {"messages": [{"role": "user", "content": "json"}], "thinking": {"type": "enabled"},
                                "response_format": {"type": "json_object"}})
    end = fmt.marker_ids["</think>"]
    assert _admits(env, tag, "any {reasoning", end, '{"a": 1}', env[2].eos_id)
    assert _admits(env, tag, "any", "</thin", "k>", "{")           # spelled as text: still reasoning
    assert not _admits(env, tag, "any", "</thin", "k>", end, "x")
    assert not _admits(env, tag, "x", end, "[1]")                   # json_object: an object


def test_a_forced_tool_wins_and_auto_tools_beside_a_format_allow_either(env):
    fmt = env[0]
    d = fmt.marker_ids["｜DSML｜"]
    msgs = [{"role": "user", "content": "json"}]
    tools = [{"name": "t", "input_schema": {"type": "object", "properties": {}}}]
    out = {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}
    tag, field = _tag(env, "messages", {"messages": msgs, "max_tokens": 8, "tools": tools,
                                        "tool_choice": {"type": "tool", "name": "t"}, **out})
    assert field == "tools" and _admits(env, tag, "<", d, 'invoke name="t">\n') and not _admits(env, tag, "{")
    schema = {"type": "json_schema", "json_schema": {"name": "o", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    tag, field = _tag(env, "chat", {"messages": msgs, "tools": TOOLS[1:], "response_format": schema})
    assert field == "response_format" and _admits(env, tag, '{"a": 5}', env[2].eos_id)
    assert _admits(env, tag, "\n\n<", d, "tool_calls>\n<", d, 'invoke name="t">\n')
    assert not _admits(env, tag, "Sure")


def test_request_fields_cannot_smuggle_a_grammar_or_a_huge_one(env):
    assert sampling_params({"structured": '{"type": "structural_tag"}'}, 4, None, 1).structured is None
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200}
                                            for i in range(6000)}}
    with pytest.raises(ApiError) as e:
        _tag(env, "responses", {"input": "json", "text": {"format": {"type": "json_schema", "name": "b",
                                                                     "schema": big}}})
    assert e.value.param == "text.format" and len(e.value.message) < 200
