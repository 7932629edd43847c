"""The corpora of model outputs: chat outputs (``Case``, ``CORPUS``: text, finish, thinking, tools,
stop strings, cuts), the request variants they answer, and the /v1/responses and /v1/messages cases
(``ApiCase``); ``case_ids`` / ``chat_request`` turn a case into its output ids and its request."""
from __future__ import annotations

from dataclasses import dataclass

from engine.tokenizer import Tokenizer

MODEL = "deepseek_v4"
CHAT = "/v1/chat/completions"
STREAM_USAGE = {"stream": True, "stream_options": {"include_usage": True}}
MAX_LEN = 65536
DSML_MARK = "｜DSML｜"
THINK_END = "</think>"
EOS_TEXT = "<｜end▁of▁sentence｜>"

_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "object"},
                                            "q": {"type": "string"}, "n": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "f", "description": "a test tool", "parameters": _SCHEMA}},
         {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
R_TOOLS = [{"type": "function", "name": "f", "parameters": _SCHEMA}]          # Responses
M_TOOLS = [{"name": "f", "description": "a test tool", "input_schema": _SCHEMA}]  # Messages


def _param(name: str, value: str, string: bool = True) -> str:
    kind = "true" if string else "false"
    return f'<｜DSML｜parameter name="{name}" string="{kind}">{value}</｜DSML｜parameter>\n'


def _invoke(name: str, *params: str) -> str:
    return f'<｜DSML｜invoke name="{name}">\n' + "".join(params) + "</｜DSML｜invoke>\n"


def _block(*invokes: str) -> str:
    return "<｜DSML｜tool_calls>\n" + "".join(invokes) + "</｜DSML｜tool_calls>"


#: the brief's block: one invoke, a string and a JSON parameter, after a blank line
DSML = "\n\n" + _block(_invoke("f", _param("a", "x"), _param("b", '{"k": [1, 2]}', False)))
DSML3 = "\n\n" + _block(_invoke("f", _param("a", "one"), _param("n", "7", False)),
                        _invoke("g"),
                        _invoke("f", _param("q", 'line1\nsays "hi" \\ tab\t'),
                                _param("b", '{"z": null}', False)))
DSML_CJK = "\n\n" + _block(_invoke("f", _param("q", "天气怎么样？🌦️"),
                                   _param("b", '{"城市": ["北京"]}', False)))


@dataclass(frozen=True)
class Case:
    """One model output. ``text`` is tokenised; ``finish`` "stop" appends EOS; ``cut`` keeps the
    text before its first occurrence, or (an int) drops that many characters from the end (a length
    cut mid-output); ``drop`` removes that many ids from the end (a cut inside a character)."""

    name: str
    text: str
    finish: str = "stop"
    think: bool = True
    tools: bool = False
    stop: tuple[str, ...] = ()
    cut: str | int | None = None
    drop: int = 0
    variant: str = ""       # a key of VARIANTS: more request fields (tool_choice, a prefix continuation)


FULL = "Plan the call.\n</think>\n\nCalling f." + DSML
#: what the model writes after a prompt that opened the tool-call block (tool_choice required / named)
INSIDE_BLOCK = _invoke("f", _param("a", "x"), _param("b", '{"k": [1, 2]}', False)) + "</｜DSML｜tool_calls>"
VARIANTS = {
    "": {},
    "required": {"tool_choice": "required"},
    "named": {"tool_choice": {"type": "function", "function": {"name": "f"}}},
    "none": {"tool_choice": "none"},
    # DeepSeek's prefix continuation: the last assistant message is continued
    "prefix-reasoning": {"prefix": {"role": "assistant", "content": "", "reasoning_content": "Partial",
                                    "prefix": True}},
    "prefix-content": {"prefix": {"role": "assistant", "content": "The ans", "reasoning_content": "Done.",
                                  "prefix": True}},
    "prefix-chat": {"prefix": {"role": "assistant", "content": "The ans", "prefix": True}},
}
CORPUS = [
    # plain answers, chat mode
    Case("chat-plain", "Hello, world! How can I help?", think=False),
    Case("chat-multiline", "Line one.\nLine two.\n\n- a\n- b\n\n```py\nprint(1)\n```", think=False),
    Case("chat-length", "The answer is 42 and the reason is", "length", think=False),
    Case("chat-only-eos", "", think=False),
    Case("chat-tools-no-call", "No tool is needed for that.", think=False, tools=True),
    Case("chat-think-tag", "abc</think>def", think=False),
    Case("chat-leading-newlines", "\n\nAnswer after newlines.\n", think=False),
    # thinking mode: reasoning, </think>, answer
    Case("think-basic", "Let me think.</think>The answer is 4."),
    Case("think-newlines", "Reasoning here.\n</think>\n\nAnswer."),
    Case("think-many-newlines", "\n\nLeading newlines.\n\n\n</think>\n\n\nAnswer with trailing\n\n"),
    Case("think-length", "I am still thinking about the", "length"),
    Case("think-no-end-stop", "Only reasoning, then EOS"),
    Case("think-empty-reasoning", "</think>Direct answer."),
    Case("think-empty-answer", "Reasoning only.\n</think>\n"),
    Case("think-second-end", "a</think>b</think>c"),
    Case("think-only-eos", ""),
    Case("think-tools-no-call", "Think.</think>Plain answer.", tools=True),
    Case("think-length-after-end", "Done thinking.</think>Partial ans", "length"),
    # DSML tool calls
    Case("dsml-chat", "Hello" + DSML, think=False, tools=True),
    Case("dsml-chat-only", DSML.lstrip("\n"), think=False, tools=True),
    Case("dsml-think", FULL, tools=True),
    Case("dsml-think-no-content", "Plan.</think>" + DSML, tools=True),
    Case("dsml-three-invokes", "R.</think>Three calls." + DSML3, tools=True),
    Case("dsml-three-invokes-chat", "Three calls." + DSML3, think=False, tools=True),
    Case("dsml-no-blank-line", "R.</think>Hi" + DSML.lstrip("\n"), tools=True),
    Case("dsml-text-after", "R.</think>Hi" + DSML + "\n\nText after the block."),
    Case("dsml-text-after-tools", "R.</think>Hi" + DSML + "\n\nText after the block.", tools=True),
    Case("dsml-in-reasoning-length", "Thinking" + DSML, "length", tools=True),
    Case("dsml-in-reasoning-stop", "Thinking" + DSML, tools=True),
    Case("dsml-cjk-values", "想一想。</think>好的" + DSML_CJK, tools=True),
    Case("dsml-unknown-function", "R.</think>Hi" + DSML.replace('name="f"', 'name="nope"'), tools=True),
    Case("dsml-no-tools-declared", "R.</think>Hi" + DSML),
    Case("dsml-no-tools-chat", "Hi" + DSML, think=False),
    # malformed DSML
    Case("bad-attribute", "R.</think>Hi" + DSML.replace('string="true"', 'strin="yes"'), tools=True),
    Case("unclosed-parameter", "R.</think>Hi" + DSML.replace("x</｜DSML｜parameter>", "x"), tools=True),
    Case("wrong-closing-tag", "R.</think>Hi" + DSML.replace("</｜DSML｜invoke>", "</｜DSML｜parameter>"),
         tools=True),
    Case("non-json-value", "R.</think>Hi" + DSML.replace('{"k": [1, 2]}', "{k: oops"), tools=True),
    Case("unclosed-block", "R.</think>Hi" + DSML.replace("</｜DSML｜tool_calls>", ""), tools=True),
    # truncated DSML (cut by length mid-block)
    Case("cut-in-open-marker", FULL, "length", tools=True, cut="ML｜tool_calls>"),
    Case("cut-after-open-marker", FULL, "length", tools=True, cut="\n<｜DSML｜invoke"),
    Case("cut-in-invoke-name", FULL, "length", tools=True, cut='f">'),
    Case("cut-in-json-value", FULL, "length", tools=True, cut=" 2]}"),
    Case("cut-before-close", FULL, "length", tools=True, cut="</｜DSML｜tool_calls>"),
    Case("cut-in-close-marker", FULL, "length", tools=True, cut=len("｜tool_calls>")),
    # CJK / emoji split across tokens
    Case("cjk-chat", "你好，世界！🌍🚀 family: 👨‍👩‍👧 flags: 🇯🇵", think=False),
    Case("cjk-think", "思考：😀🤔 嗯。</think>答案是四。🎉"),
    Case("emoji-cut-mid-char", "Weather: 🌍", "length", think=False, drop=1),
    # stop strings
    Case("stop-in-reasoning", "I think so.</think>Final answer.", stop=("think",)),
    Case("stop-straddles-end", "I think so.</think>Final answer.", stop=("so.</think>Fi",)),
    Case("stop-is-think-end", "I think so.\n</think>\n\nFinal answer.", stop=("</think>",)),
    Case("stop-in-content", "Think.</think>Answer: yes. END and more.", stop=("END",)),
    Case("stop-in-chat", "one two three four", think=False, stop=("three",)),
    Case("stop-across-tokens", "Hello world, again.", think=False, stop=("lo wo",)),
    Case("stop-at-content-start", "R.</think>STOP the rest", stop=("STOP",)),
    Case("stop-near-miss", "R.</think>STOP nearly, then STOP here and more", stop=("STOP here",)),
    Case("stop-cjk", "想。</think>你好世界和平", stop=("世界",)),
    Case("stop-never", "R.</think>Nothing matches here", "length", stop=("zzz",)),
    Case("stop-before-eos", "R.</think>abc END", stop=("END",)),
    Case("stop-in-tool-block", FULL, tools=True, stop=('"k"', "parameter", "DSML")),
    Case("stop-after-tool-block", "R.</think>Hi" + DSML + "\n\nafter END", tools=True, stop=("END",)),
    Case("two-stops-later-first", "R.</think>a yy b zz c", stop=("zz", "yy")),
    Case("two-stops-chat", "a yy b zz c", think=False, stop=("zz", "yy")),
    # tool_choice and prefix continuations (the recipe's other parse start states)
    Case("tool-choice-required", INSIDE_BLOCK, think=False, tools=True, variant="required"),
    Case("tool-choice-required-cut", INSIDE_BLOCK, "length", think=False, tools=True, variant="required",
         cut="1, 2"),
    Case("tool-choice-named", INSIDE_BLOCK + "\n\nignored", think=False, tools=True, variant="named"),
    Case("tool-choice-none", "R.</think>Hi" + DSML, tools=True, variant="none"),
    Case("prefix-reasoning", " more reasoning.\n</think>\n\nAnswer", variant="prefix-reasoning"),
    Case("prefix-reasoning-length", " still going", "length", variant="prefix-reasoning"),
    Case("prefix-content", "\nwer is 4.", variant="prefix-content"),
    Case("prefix-chat", "\nwer is 4.", think=False, variant="prefix-chat"),
]


@dataclass(frozen=True)
class ApiCase:
    name: str
    api: str                # "responses" / "messages"
    body: dict
    text: str
    finish: str = "stop"
    check: dict | None = None   # what the recipe's response must show (so the case tests what it says)


MSG = [{"role": "user", "content": "What is the weather?"}]
API_CASES = [
    ApiCase("responses-reasoning-content-call", "responses", {"input": "weather?", "tools": R_TOOLS}, FULL,
            check={"types": ["reasoning", "message", "function_call"], "status": "completed"}),
    ApiCase("responses-length", "responses", {"input": "weather?"}, "Thinking.</think>It is sunny and", "length",
            check={"types": ["reasoning", "message"], "status": "incomplete"}),
    ApiCase("responses-no-reasoning", "responses", {"input": "weather?", "reasoning": {"effort": "none"}},
            "Sunny, 25°C. 🌞", check={"types": ["message"], "status": "completed"}),
    ApiCase("responses-three-calls", "responses", {"input": "weather?", "tools": R_TOOLS},
            "R.</think>" + DSML3.lstrip("\n"),
            check={"types": ["reasoning", "function_call", "function_call", "function_call"]}),
    ApiCase("messages-thinking-text-tool-use", "messages",
            {"messages": MSG, "max_tokens": 1024, "tools": M_TOOLS,
             "thinking": {"type": "enabled", "budget_tokens": 512}}, FULL,
            check={"types": ["thinking", "text", "tool_use"], "stop_reason": "tool_use"}),
    ApiCase("messages-stop-sequence", "messages",
            {"messages": MSG, "max_tokens": 1024, "stop_sequences": ["zz", "END"],
             "thinking": {"type": "enabled", "budget_tokens": 512}},
            "I END here? No.</think>Sunny. END of answer zz",
            check={"types": ["thinking", "text"], "stop_reason": "stop_sequence", "stop_sequence": "END",
                   "text": "Sunny. "}),
    ApiCase("messages-stop-sequence-in-thinking-only", "messages",
            {"messages": MSG, "max_tokens": 1024, "stop_sequences": ["END"],
             "thinking": {"type": "enabled", "budget_tokens": 512}},
            "Thinking about the END.</think>Sunny.",
            check={"types": ["thinking", "text"], "stop_reason": "end_turn", "text": "Sunny."}),
    ApiCase("messages-max-tokens", "messages",
            {"messages": MSG, "max_tokens": 1024, "thinking": {"type": "disabled"}},
            "Sunny and warm, with", "length", check={"types": ["text"], "stop_reason": "max_tokens"}),
    ApiCase("messages-stop-in-tool-block", "messages",
            {"messages": MSG, "max_tokens": 1024, "tools": M_TOOLS, "stop_sequences": ['"k"', "DSML"],
             "thinking": {"type": "disabled"}},
            "Calling." + DSML, check={"types": ["text", "tool_use"], "stop_reason": "tool_use"}),
]


def case_ids(tok: Tokenizer, c: Case) -> list[int]:
    text = (c.text if c.cut is None else c.text[:-c.cut] if isinstance(c.cut, int)
            else c.text[:c.text.index(c.cut)])
    ids = tok.encode(text)
    ids = ids[:len(ids) - c.drop]
    return ids + [tok.eos_id] if c.finish == "stop" else ids


def chat_request(c: Case) -> dict:
    extra = dict(VARIANTS[c.variant])
    prefix = [extra.pop("prefix")] if "prefix" in extra else []
    b = {"model": MODEL, "messages": [{"role": "user", "content": f"Case {c.name}"}, *prefix],
         "thinking": {"type": "enabled" if c.think else "disabled"}, **extra}
    if c.tools:
        b["tools"] = TOOLS
    if c.stop:
        b["stop"] = list(c.stop)
    return b
