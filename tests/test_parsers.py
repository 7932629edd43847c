"""engine.parsers: reasoning / content / DSML tool calls, identical whole, split anywhere, or streamed."""
from __future__ import annotations

import json

import pytest

from engine.chat import encode_messages
from engine.detokenizer import IncrementalDetokenizer
from engine.parsers import DSMLError, OutputParser, ReasoningParser, ToolCallParser, parse_completion
from engine.tokenizer import Tokenizer

E = "<｜end▁of▁sentence｜>"
TC0, TC1 = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"


def inv(name, *params):
    body = "\n".join(f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>' for k, s, v in params)
    return f'<｜DSML｜invoke name="{name}">\n{body}\n</｜DSML｜invoke>'


WEATHER = inv("get_weather", ("city", "true", "Paris 巴黎"), ("days", "false", "2"))
NOOP = inv("noop")
MULTILINE = inv("write", ("path", "true", "a.py"), ("text", "true", 'print("hi")\n# </｜DSML｜invoke> in a string\n'),
                ("opts", "false", '{"mode": [1, 2.5, null, true]}'))


def block(*invokes):
    return f"\n\n{TC0}\n" + "\n".join(invokes) + f"\n{TC1}"


def call(name, args):
    return (name, args)


# (id, text, thinking, tools_enabled, reasoning, content, [(name, args)], error?)
CASES = [
    ("thinking_tools", f"Let me think about 天气 🌤️.</think>I'll check.{block(WEATHER, NOOP)}{E}", True, True,
     "Let me think about 天气 🌤️.", "I'll check.",
     [call("get_weather", {"city": "Paris 巴黎", "days": 2}), call("noop", {})], False),
    ("thinking_plain", "a < b and </thi is not a marker</think>Answer: 42 🚀", True, True,
     "a < b and </thi is not a marker", "Answer: 42 🚀", [], False),
    ("model_opens_think", "<think>R</think>C", True, False, "R", "C", [], False),
    ("no_end_of_thinking", "still thinking <th", True, True, "still thinking <th", "", [], False),
    ("chat_verbatim", "<think>x</think>y\n\n<｜DSML｜tool_calls>", False, False, "",
     "<think>x</think>y\n\n<｜DSML｜tool_calls>", [], False),
    ("chat_tools_only", f"{block(MULTILINE)}{E}", False, True, "", "",
     [call("write", {"path": "a.py", "text": 'print("hi")\n# </｜DSML｜invoke> in a string\n',
                     "opts": {"mode": [1, 2.5, None, True]}})], False),
    ("eos_ends_output", f"done{E}ignored </think> text", False, True, "", "done", [], False),
    ("content_newlines", "line\n\nline2\n\n<not dsml>\n\n<｜D", False, True, "", "line\n\nline2\n\n<not dsml>\n\n<｜D",
     [], False),
    # malformed DSML: the text not turned into calls comes back as content
    ("bad_param", f"ok{block(inv('f', ('a', 'maybe', '1')))}", False, True, "",
     f"ok{block(inv('f', ('a', 'maybe', '1')))}", [], True),
    ("bad_json", f"ok{block(inv('f', ('a', 'false', '{x')))}{E}", False, True, "",
     f"ok{block(inv('f', ('a', 'false', '{x')))}", [], True),
    ("duplicate_param", f"{block(inv('f', ('a', 'true', '1'), ('a', 'true', '2')))}", False, True, "",
     block(inv('f', ('a', 'true', '1'), ('a', 'true', '2'))), [], True),
    ("second_invoke_bad", f"x{block(NOOP, inv('g', ('k', 'false', 'nope')))}", False, True, "",
     "x" + "\n" + inv('g', ('k', 'false', 'nope')) + f"\n{TC1}", [call("noop", {})], True),
    ("unterminated", f"x\n\n{TC0}\n{WEATHER}\n<｜DSML｜inv", False, True, "", "x\n<｜DSML｜inv",
     [call("get_weather", {"city": "Paris 巴黎", "days": 2})], True),
    ("text_after_block", f"R</think>x{block(NOOP)} trailing{E}more", True, True, "R", "x trailing",
     [call("noop", {})], True),
]
IDS = [c[0] for c in CASES]


def collect(parser, pieces):
    d = sum((parser.feed(p) for p in pieces), start=parser.feed("")) + parser.finish()
    return d.reasoning_content, d.content, d.tool_calls


def simple(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return Tokenizer(tiny_ckpt("flash", 1))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_whole_text(case):
    _, text, thinking, tools, reasoning, content, calls, error = case
    p = OutputParser(thinking, tools)
    r, c, tc = collect(p, [text])
    assert (r, c, simple(tc)) == (reasoning, content, calls)
    assert (p.tool_call_error is not None) == error
    assert [x["id"] for x in tc] == [f"call_{i}" for i in range(len(tc))]
    assert all(x["type"] == "function" for x in tc)
    assert parse_completion(text, thinking, tools) == (r, c, tc)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_split_position_and_char_by_char(case):
    _, text, thinking, tools = case[:4]
    whole = parse_completion(text, thinking, tools)
    for i in range(len(text) + 1):
        assert collect(OutputParser(thinking, tools), [text[:i], text[i:]]) == whole, i
    assert collect(OutputParser(thinking, tools), list(text)) == whole


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_token_by_token_through_detokenizer(tok, case, skip):
    _, text, thinking, tools = case[:4]
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("<｜User｜>Q<｜Assistant｜><think>"),
                                   skip_special_tokens=skip)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    streamed = collect(OutputParser(thinking, tools), pieces)
    assert streamed == parse_completion("".join(pieces), thinking, tools)
    if skip is False or E not in text:
        assert streamed == parse_completion(text, thinking, tools)


def test_partial_markers_are_held_back():
    p = ReasoningParser(thinking=True)
    assert p.feed("<thi").reasoning_content == ""
    assert p.feed("nk>abc</th").reasoning_content == "abc"
    d = p.feed("ink>x")
    assert (d.reasoning_content, d.content) == ("", "x")
    t = ToolCallParser()
    assert t.feed("Hi\n\n<｜DS").content == "Hi"
    assert t.feed("ML｜tool_calls>\n").content == ""
    assert t.feed(NOOP).tool_calls[0]["function"] == {"name": "noop", "arguments": "{}"}
    assert not t.feed("\n" + TC1) and not t.finish() and t.error is None
    u = ToolCallParser()
    assert u.feed("a\n\n").content == "a" and u.feed("b").content == "\n\nb"


def test_tool_call_ids_from_prefix():
    text = block(NOOP, NOOP, WEATHER)
    _, _, calls = parse_completion(text, False, True, id_prefix="chatcmpl-7-")
    assert [c["id"] for c in calls] == ["chatcmpl-7-0", "chatcmpl-7-1", "chatcmpl-7-2"]
    assert calls[2]["function"]["arguments"] == '{"city": "Paris 巴黎", "days": 2}'


def test_strict_mode_raises():
    p = ToolCallParser(fallback_to_content=False)
    p.feed(f"x\n\n{TC0}\n")
    with pytest.raises(DSMLError, match="invoke"):
        p.feed('<｜DSML｜invoke nam="f">\n\n</｜DSML｜invoke>')
    q = ToolCallParser(fallback_to_content=False)
    q.feed(f"x\n\n{TC0}\n{NOOP}")
    with pytest.raises(DSMLError, match="unterminated|expected"):
        q.finish()


def test_round_trip_with_encoder():
    """What encode_messages renders for an assistant turn parses back to the same message."""
    args = {"q": "天气 \"x\" <b>", "n": -1.5e3, "ok": False, "none": None, "l": [1, "a", {"k": []}], "o": {}}
    calls = [{"id": "1", "type": "function", "function": {"name": "search", "arguments": json.dumps(args)}},
             {"id": "2", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]
    for mode in ("thinking", "chat"):
        prompt = encode_messages([{"role": "user", "content": "Q"}], mode)
        full = encode_messages([{"role": "user", "content": "Q"},
                                {"role": "assistant", "content": "Sure.", "reasoning_content": "hmm",
                                 "tool_calls": calls}], mode)
        # the transition after the user turn is identical; the completion is the rest
        completion = full[len(prompt):] if full.startswith(prompt) else None
        assert completion is not None and completion.endswith(E)
        r, c, tc = parse_completion(completion, mode == "thinking", True)
        assert (r, c) == ("hmm" if mode == "thinking" else "", "Sure.")
        assert simple(tc) == [("search", args), ("noop", {})]
