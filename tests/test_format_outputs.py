"""Output processing through the real gateway equals DeepSeek's recipe for the same token ids.

The gateway parses model output with DeepSeek's own library (``deepseek_recipe``): one
``StreamProcessor`` per sample, fed by ``server.gateway.recipe_stream.RecipeAssembler`` under vLLM's token
rules, shaped per API by ``server.gateway.chat_completions`` / ``server.gateway.responses`` /
``server.gateway.messages``. This module
checks that nothing is lost or changed on the way: for a corpus of model outputs (text tokenised
with the tiny checkpoint's real DeepSeek-V4 tokenizer, EOS appended where the output ends with
finish "stop"; the others end by "length") the expected value is computed here by feeding the same
ids straight into a ``deepseek_recipe.StreamProcessor`` built from the same request's conversion
(one token per ``tokens`` chunk, the final stop token as ``InferenceChunk.text("", 1)``, then
``finish``), and the gateway must give the same message (content, reasoning_content, tool calls
with their parsed JSON arguments; tool-call ids are random), finish_reason and usage
(completion / reasoning tokens):

* non-streamed and streamed (SSE re-assembled), through the ASGI app over a scripted backend that
  emits one token per event, all ids in one event, and two events split at sampled k;
* at every split point k (two events: ids[:k], ids[k:]) through the chat job and its assemblers
  directly, streamed (with return_token_ids: the ids come back whole) and not;
* /v1/responses and /v1/messages: the recipe's whole response object and its whole event sequence
  (ids and timestamps aside), stop_sequences / stop_reason included;
* the gateway's extras beyond the recipe (chat): n=3, return_token_ids, include_stop_str_in_output
  (stop string, stop token), stream_options.include_usage / continuous_usage_stats,
  skip_special_tokens with EOS / BOS mid-output (ignore_eos), logprobs.

Why: the tiny random model never writes ``</think>`` or DSML, so the gateway's output path is only
exercised by scripted ids; the recipe is the reference for what DeepSeek's API returns for them.
With tools declared, raw DSML markup must never reach ``content`` (malformed or truncated blocks
included); a stop string inside reasoning or inside a tool-call block must not cut the output.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

import deepseek_recipe as dr
import httpx
import pytest

from engine.core.sampling_params import Sampled
from engine.tokenizer import Tokenizer
from serve_util import ScriptedBackend, reasoning_from_ids, set_reasoning_usage
from server.backends.base import TokenEvent
from server.gateway.app import create_app
from server.gateway.chat_completions import prepare_chat
from server.gateway.dsformat import DeepSeekFormat
from server.gateway.protocol import ChatCompletionRequest

MODEL = "deepseek_v4"
CHAT = "/v1/chat/completions"
STREAM_USAGE = {"stream": True, "stream_options": {"include_usage": True}}
MAX_LEN = 65536
DSML_MARK = "｜DSML｜"
THINK_END = "</think>"
EOS_TEXT = "<｜end▁of▁sentence｜>"
FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length}
OPTIONS = dr.ConversionOptions().with_model_versions_by_name({MODEL: dr.ModelVersion.DeepseekV4Pro})

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


# ---- the reference: the recipe fed directly -------------------------------------------------------------
_REQ = {"chat": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest, "messages": dr.MessagesRequest}
_RESP = {"chat": dr.ChatCompletionResponse, "responses": dr.ResponsesResponse, "messages": dr.MessagesResponse}


@dataclass
class Expected:
    response: dict          # the recipe's accumulated response
    events: list[dict]      # its chunks / events, in order (SSE name in "_event" for Responses / Messages)
    prompt_ids: list[int]
    consumed: int           # ids pushed before the output ended (a matched stop sequence ends it early)


def recipe(rtok: dr.Tokenizer, api: str, body: dict, ids: list[int], finish: str, blank=None,
           logprobs=None) -> Expected:
    """What DeepSeek's recipe gives for ``ids`` answering ``body``: one token per chunk; the ids at
    positions in ``blank`` (default: the final stop token of a "stop" output) as counted tokens
    without text; a matched stop sequence ends the output."""
    req = _REQ[api]({**body, "model": MODEL})
    echo = req.echo() if api == "responses" else None
    cr = req.convert(OPTIONS)
    prompt = dr.DeepseekV4Encoding().with_tokenizer(rtok).encode(cr.conversation)
    gen = _REQ[api].chunk_generator(cr, "RID", MODEL)
    if echo is not None:
        gen = gen.with_echo(echo)
    proc = dr.StreamProcessor(gen, cr.parsing_options, rtok)
    if blank is None:
        blank = {len(ids) - 1} if finish == "stop" else set()
    out = proc.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=len(prompt))))
    consumed = 0
    for k, t in enumerate(ids):
        consumed += 1
        if k in blank:
            out += proc.push(dr.InferenceChunk.text("", 1))
        else:
            out += proc.push(dr.InferenceChunk.tokens([t], None if logprobs is None else [logprobs[k]]))
        if proc.finished:
            break
    if not proc.finished:
        out += proc.push(dr.InferenceChunk.finish(FINISH[finish]))
        out += proc.finish()
    acc = _RESP[api]("RID", MODEL, 0, len(prompt), 0)
    # reasoning tokens as the gateway counts them: from the ids, not the recipe's re-encoding
    po = cr.parsing_options
    stage = po.thinking_initial_stage
    n_reason = reasoning_from_ids(ids[:consumed], stage is not None and stage.starts_in_reasoning()
                                  and not po.starts_in_tool_calls, blank)
    events = []
    for c in out:
        d = set_reasoning_usage(json.loads(c.to_json()), n_reason)
        if api != "chat":
            d["_event"] = _RESP[api].sse_event_name(c)
        events.append(d)
        acc.accumulate(c)              # consumes the chunk
    return Expected(set_reasoning_usage(json.loads(acc.to_json()), n_reason), events, prompt, consumed)


# ---- comparing chat outputs --------------------------------------------------------------------------------
def _args(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return s                    # malformed arguments compare as text


def _calls(tool_calls) -> list:
    out = []
    for tc in tool_calls or []:
        assert re.fullmatch(r"call_\w+", tc["id"]) and tc["type"] == "function", tc
        out.append((tc["function"]["name"], _args(tc["function"]["arguments"])))
    return out


def summary(message: dict, finish: str, usage: dict | None) -> dict:
    """What must agree: text, reasoning, calls (name, parsed arguments), finish, token counts."""
    usage = usage or {}
    return {"content": message.get("content") or "", "reasoning": message.get("reasoning_content") or "",
            "calls": _calls(message.get("tool_calls")), "finish": finish,
            "completion_tokens": usage.get("completion_tokens"),
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")}


def exact_message(message: dict) -> dict:
    """The whole message, tool-call ids (random) replaced."""
    m = json.loads(json.dumps(message))
    for tc in m.get("tool_calls") or []:
        tc["id"] = "ID"
    return m


def chat_want(exp: Expected, ends_mid_char: bool = False) -> dict:
    """The recipe's summary, with usage counting every token the gateway consumed. The recipe does
    not count a final token whose bytes never complete a character (its text is never output);
    the engine generated it, so the gateway's usage counts it, as vLLM's does."""
    want = body_summary(exp.response)
    if ends_mid_char:
        assert want["completion_tokens"] == exp.consumed - 1, want
        want["completion_tokens"] = exp.consumed
    assert want["completion_tokens"] == exp.consumed, want
    return want


def body_summary(d: dict, i: int = 0) -> dict:
    c = d["choices"][i]
    return summary(c["message"], c["finish_reason"], d["usage"])


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE message."""
    out = []
    for msg in text.split("\n\n"):
        if not msg.strip():
            continue
        name, data = None, []
        for line in msg.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        out.append((name, "\n".join(data)))
    return out


def chat_chunks(text: str) -> list[dict]:
    msgs = parse_sse(text)
    assert msgs and msgs[-1] == (None, "[DONE]"), text[-300:]
    return [json.loads(d) for _, d in msgs[:-1]]


def assemble(chunks: list[dict]) -> dict[int, dict]:
    """Streamed chat chunks -> per choice index: summary fields + token_ids + logprobs."""
    out: dict[int, dict] = {}
    usage = None
    for ch in chunks:
        assert ch["object"] == "chat.completion.chunk" and "error" not in ch, ch
        if ch.get("usage"):
            usage = ch["usage"]
        for c in ch["choices"]:
            s = out.setdefault(c["index"], {"content": "", "reasoning": "", "calls": {}, "finish": None,
                                            "roles": [], "token_ids": [], "logprobs": {}})
            d = c.get("delta") or {}
            if "role" in d:
                s["roles"].append(d["role"])
            s["content"] += d.get("content") or ""
            s["reasoning"] += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                call = s["calls"].setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or tc.get("id")
                f = tc.get("function") or {}
                call["name"] += f.get("name") or ""
                call["arguments"] += f.get("arguments") or ""
            if c.get("finish_reason") is not None:
                assert s["finish"] is None, "two finish reasons"
                s["finish"] = c["finish_reason"]
            s["token_ids"] += c.get("token_ids") or []
            for key, entries in (c.get("logprobs") or {}).items():
                s["logprobs"].setdefault(key, []).extend(entries or [])
    for s in out.values():
        assert sorted(s["calls"]) == list(range(len(s["calls"]))), "tool-call indexes 0, 1, ..."
        calls = [s["calls"][i] for i in sorted(s["calls"])]
        assert all(c["id"] and re.fullmatch(r"call_\w+", c["id"]) for c in calls), calls
        s["calls"] = [(c["name"], _args(c["arguments"])) for c in calls]
        s["usage"] = usage
    return out


def stream_summary(s: dict) -> dict:
    """``summary`` of a re-assembled choice; the usage of the stream's usage chunk."""
    u = s["usage"] or {}
    return {"content": s["content"], "reasoning": s["reasoning"], "calls": s["calls"], "finish": s["finish"],
            "completion_tokens": u.get("completion_tokens"),
            "reasoning_tokens": (u.get("completion_tokens_details") or {}).get("reasoning_tokens")}


# ---- fixtures ---------------------------------------------------------------------------------------------
class Scripted(ScriptedBackend):
    """``ScriptedBackend`` with the script set per request, optional explicit event boundaries
    (``cuts``: events ids[0:c0], ids[c0:c1], ..., ids[cn:]) and optional logprobs (one
    ``Sampled`` per id, from ``logprobs``: id position -> Sampled)."""

    def __init__(self):
        super().__init__(lambda _prompt: self.script, split=1, max_model_len=MAX_LEN)
        self.script: tuple[list[int], str] = ([], "stop")
        self.cuts: list[int] | None = None
        self.logprobs: list[Sampled] | None = None

    def set(self, ids, reason, split=1, cuts=None, logprobs=None):
        self.script, self.split, self.cuts, self.logprobs = (list(ids), reason), split, cuts, logprobs

    async def generate(self, req):
        if self.cuts is None and self.logprobs is None:
            async for ev in super().generate(req):
                yield ev
            return
        self.requests.append(req)
        ids, reason = self.script
        bounds = ([0, *self.cuts, len(ids)] if self.cuts is not None
                  else list(range(0, len(ids), self.split or len(ids))) + [len(ids)])
        for a, b in zip(bounds, bounds[1:]):
            last = b == len(ids)
            yield TokenEvent(ids[a:b], None if self.logprobs is None else self.logprobs[a:b], finished=last,
                             finish_reason=reason if last else None, num_prompt_tokens=len(req.prompt_ids))


@dataclass
class Stack:
    tok: Tokenizer
    rtok: dr.Tokenizer
    fmt: DeepSeekFormat
    backend: Scripted
    app: object


@pytest.fixture(scope="module")
def stack(tiny_ckpt) -> Stack:
    ckpt = tiny_ckpt("flash", 1)
    tok = Tokenizer(ckpt)
    backend = Scripted()
    fmt = DeepSeekFormat(ckpt, MODEL)
    return Stack(tok, dr.Tokenizer.from_file(str(ckpt / "tokenizer.json")), fmt, backend,
                 create_app(backend, tok, MODEL, fmt=fmt))


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


class Client:
    """Requests to the ASGI app, each with the backend scripted for it."""

    def __init__(self, st: Stack, h: httpx.AsyncClient):
        self.st, self.h = st, h

    async def post(self, path, body, ids, reason, **script):
        self.st.backend.set(ids, reason, **script)
        r = await self.h.post(path, json=body)
        assert r.status_code == 200, (r.status_code, r.text[:500])
        return r.json() if not body.get("stream") else r.text


def run(st: Stack, fn):
    async def go():
        transport = httpx.ASGITransport(app=st.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as h:
            return await fn(Client(st, h))
    return asyncio.run(go())


# ---- 1. the corpus through /v1/chat/completions ----------------------------------------------------------
def test_corpus_covers_the_brief(stack):
    st = stack
    assert len(CORPUS) >= 45 and len({c.name for c in CORPUS}) == len(CORPUS)
    assert {c.think for c in CORPUS} == {True, False} and {c.tools for c in CORPUS} == {True, False}
    assert {c.finish for c in CORPUS} == {"stop", "length"}
    eos = st.tok.eos_id
    for c in CORPUS:
        ids = case_ids(st.tok, c)
        assert (ids[-1:] == [eos]) == (c.finish == "stop") and eos not in ids[:-1], c.name
    # the emoji case really is cut inside a character: its ids do not decode to whole characters
    e = next(c for c in CORPUS if c.name == "emoji-cut-mid-char")
    assert "\ufffd" in st.tok.decode(case_ids(st.tok, e))


@pytest.mark.parametrize("c", CORPUS, ids=lambda c: c.name)
def test_chat_corpus_equals_recipe(stack, c):
    st = stack
    ids = case_ids(st.tok, c)
    body = chat_request(c)
    exp = recipe(st.rtok, "chat", body, ids, c.finish)
    want_msg = exact_message(exp.response["choices"][0]["message"])
    want = chat_want(exp, c.drop > 0)
    _check_case_invariants(c, want)
    L = len(ids)
    ks = sorted({1, L // 2, L - 1} - {0, L}) if L > 1 else []

    async def go(cl: Client):
        got_body = await cl.post(CHAT, body, ids, c.finish)
        assert st.backend.requests[-1].prompt_ids == exp.prompt_ids     # the recipe's prompt, encoded alike
        sbody = {**body, **STREAM_USAGE}
        streams = {"split=1": await cl.post(CHAT, sbody, ids, c.finish, split=1),
                   "one event": await cl.post(CHAT, sbody, ids, c.finish, split=0)}
        for k in ks:
            streams[f"k={k}"] = await cl.post(CHAT, sbody, ids, c.finish, cuts=[k])
        return got_body, streams

    got_body, streams = run(st, go)
    assert exact_message(got_body["choices"][0]["message"]) == want_msg
    assert body_summary(got_body) == want
    assert got_body["usage"]["prompt_tokens"] == len(exp.prompt_ids)
    assert got_body["usage"]["total_tokens"] == len(exp.prompt_ids) + want["completion_tokens"]
    for how, text in streams.items():
        chunks = chat_chunks(text)
        s = assemble(chunks)
        assert list(s) == [0], how
        assert stream_summary(s[0]) == want, how
        assert s[0]["roles"] == ["assistant"] and chunks[-1]["choices"] == [], how
        assert all(ch["usage"] is None for ch in chunks[:-1]), how


def _check_case_invariants(c: Case, want: dict) -> None:
    """What the brief promises of the reference itself, so the corpus tests what it claims."""
    if c.tools and c.variant != "none":
        assert DSML_MARK not in want["content"], (c.name, want)
    if c.variant in ("required", "named"):
        assert want["calls"] and want["finish"] == ("tool_calls" if c.finish == "stop" else "length"), want
    if c.think:
        assert THINK_END not in want["content"] and THINK_END not in want["reasoning"]
    if c.name in ("stop-in-reasoning", "stop-straddles-end", "stop-is-think-end"):
        assert want["reasoning"] == "I think so." and want["content"] == "Final answer.", want
    if c.name == "stop-in-tool-block":
        assert want["calls"] == [("f", {"a": "x", "b": {"k": [1, 2]}})] and want["finish"] == "tool_calls"
    if c.name.startswith("two-stops"):
        assert want["content"] == "a " and want["finish"] == "stop"
    if c.name.startswith("dsml-") and c.tools and "unknown" not in c.name:
        assert want["calls"] and want["calls"][0][0] == "f", want


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
def test_every_split_point_at_the_job_level(stack, stream):
    """Two events split at token boundary k, for every k and every corpus output, through
    ``prepare_chat`` / ``ChatJob`` / its assemblers (what the gateway's ``Generation`` drives);
    streamed with return_token_ids and include_usage, so the ids must also come back whole."""
    st = stack
    for c in CORPUS:
        ids = case_ids(st.tok, c)
        body = chat_request(c)
        exp = recipe(st.rtok, "chat", body, ids, c.finish)
        want, want_msg = chat_want(exp, c.drop > 0), exact_message(exp.response["choices"][0]["message"])
        if stream:
            body = {**body, **STREAM_USAGE, "return_token_ids": True}
        for k in range(1, len(ids)):
            job, asms, sse = drive_job(st, body, [ids[:k], ids[k:]], c.finish)
            if stream:
                chunks = chat_chunks("".join(sse))
                s = assemble(chunks)[0]
                assert stream_summary(s) == want, (c.name, k)
                assert s["token_ids"] == ids[:exp.consumed], (c.name, k)
                assert all(ch["usage"] is None for ch in chunks[:-1]) and chunks[-1]["choices"] == []
            else:
                got = job.body(asms)
                assert body_summary(got) == want, (c.name, k)
                assert exact_message(got["choices"][0]["message"]) == want_msg, (c.name, k)


def drive_job(st: Stack, body: dict, events: list[list[int]], finish: str):
    """Run a chat job over scripted events the way ``server.gateway.generation.Generation`` does (feed until
    the assembler finishes; abort if the events end first). Returns (job, assemblers, SSE texts)."""
    job = prepare_chat(ChatCompletionRequest.model_validate(body), st.fmt, st.tok, MAX_LEN, 8)
    asms = {s.index: job.assembler(s) for s in job.samples}
    out = list(job.head())
    for s in job.samples:
        asm = asms[s.index]
        for j, part in enumerate(events):
            last = j == len(events) - 1
            p = asm.feed(TokenEvent(list(part), finished=last, finish_reason=finish if last else None))
            if job.stream:
                out += job.events(s, p)
            if asm.finished:
                break
        if not asm.finished:
            p = asm.abort()
            if job.stream:
                out += job.events(s, p)
    if job.stream:
        out += job.tail(asms)
    return job, asms, out


# ---- 2. /v1/responses and /v1/messages: the recipe's response object and event sequence -------------------
_TIMES = ("created_at", "completed_at")
_CALL_ID = re.compile(r"call_\d+_[A-Za-z0-9]+")


def normalise(obj, rid: str):
    """JSON with the response id as "RID" (item ids and signatures derive from it), tool-call ids
    (random) as "CALL" and timestamps as 0."""
    text = json.dumps(obj, ensure_ascii=False).replace(rid, "RID")
    text = _CALL_ID.sub("CALL", text)

    def walk(x):
        if isinstance(x, dict):
            return {k: (0 if k in _TIMES and isinstance(v, int) else walk(v)) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x
    return walk(json.loads(text))


@dataclass(frozen=True)
class ApiCase:
    name: str
    api: str                # "responses" / "messages"
    body: dict
    text: str
    finish: str = "stop"
    check: dict | None = None   # what the recipe's response must show (so the case tests what it says)


_MSG = [{"role": "user", "content": "What is the weather?"}]
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
            {"messages": _MSG, "max_tokens": 1024, "tools": M_TOOLS,
             "thinking": {"type": "enabled", "budget_tokens": 512}}, FULL,
            check={"types": ["thinking", "text", "tool_use"], "stop_reason": "tool_use"}),
    ApiCase("messages-stop-sequence", "messages",
            {"messages": _MSG, "max_tokens": 1024, "stop_sequences": ["zz", "END"],
             "thinking": {"type": "enabled", "budget_tokens": 512}},
            "I END here? No.</think>Sunny. END of answer zz",
            check={"types": ["thinking", "text"], "stop_reason": "stop_sequence", "stop_sequence": "END",
                   "text": "Sunny. "}),
    ApiCase("messages-stop-sequence-in-thinking-only", "messages",
            {"messages": _MSG, "max_tokens": 1024, "stop_sequences": ["END"],
             "thinking": {"type": "enabled", "budget_tokens": 512}},
            "Thinking about the END.</think>Sunny.",
            check={"types": ["thinking", "text"], "stop_reason": "end_turn", "text": "Sunny."}),
    ApiCase("messages-max-tokens", "messages",
            {"messages": _MSG, "max_tokens": 1024, "thinking": {"type": "disabled"}},
            "Sunny and warm, with", "length", check={"types": ["text"], "stop_reason": "max_tokens"}),
    ApiCase("messages-stop-in-tool-block", "messages",
            {"messages": _MSG, "max_tokens": 1024, "tools": M_TOOLS, "stop_sequences": ['"k"', "DSML"],
             "thinking": {"type": "disabled"}},
            "Calling." + DSML, check={"types": ["text", "tool_use"], "stop_reason": "tool_use"}),
]


def _check_api_case(c: ApiCase, resp: dict) -> None:
    chk = c.check or {}
    if c.api == "responses":
        assert [o["type"] for o in resp["output"]] == chk["types"], resp["output"]
        if "status" in chk:
            assert resp["status"] == chk["status"]
        texts = [p["text"] for o in resp["output"] if o["type"] == "message" for p in o["content"]]
    else:
        assert [b["type"] for b in resp["content"]] == chk["types"], resp["content"]
        assert resp["stop_reason"] == chk["stop_reason"] and resp["stop_sequence"] == chk.get("stop_sequence")
        texts = [b["text"] for b in resp["content"] if b["type"] == "text"]
        if "text" in chk:
            assert texts == [chk["text"]]
    assert all(DSML_MARK not in t and THINK_END not in t for t in texts), texts


@pytest.mark.parametrize("c", API_CASES, ids=lambda c: c.name)
def test_responses_and_messages_equal_recipe(stack, c):
    st = stack
    ids = st.tok.encode(c.text) + ([st.tok.eos_id] if c.finish == "stop" else [])
    body = {"model": MODEL, **c.body}
    exp = recipe(st.rtok, c.api, body, ids, c.finish)
    _check_api_case(c, exp.response)
    want = normalise(exp.response, "RID")
    want_events = [normalise(e, "RID") for e in exp.events]
    path = "/v1/responses" if c.api == "responses" else "/v1/messages"

    async def go(cl: Client):
        got = await cl.post(path, body, ids, c.finish)
        assert st.backend.requests[-1].prompt_ids == exp.prompt_ids
        sbody = {**body, "stream": True}
        streams = {"split=1": await cl.post(path, sbody, ids, c.finish, split=1),
                   "one event": await cl.post(path, sbody, ids, c.finish, split=0),
                   "k=mid": await cl.post(path, sbody, ids, c.finish, cuts=[len(ids) // 2])}
        return got, streams

    got, streams = run(st, go)
    rid = got["id"]
    assert rid.startswith("resp_" if c.api == "responses" else "msg_")
    assert normalise(got, rid) == want
    for how, text in streams.items():
        msgs = parse_sse(text)
        events = [json.loads(d) for _, d in msgs]
        assert [n for n, _ in msgs] == [e["type"] for e in events], how        # event: line == data type
        for e, (n, _) in zip(events, msgs):
            e["_event"] = n
        first = events[0]["response"]["id"] if c.api == "responses" else events[0]["message"]["id"]
        assert [normalise(e, first) for e in events] == want_events, how


# ---- 3. the gateway's extras beyond the recipe (chat) --------------------------------------------------------
def _case(name: str) -> Case:
    return next(c for c in CORPUS if c.name == name)


def _text_only(summary_: dict) -> dict:
    return {k: summary_[k] for k in ("content", "reasoning", "calls", "finish")}


def test_n3_each_choice_equals_the_single_sample_result(stack):
    st = stack
    c = _case("dsml-think")
    ids = case_ids(st.tok, c)
    exp = recipe(st.rtok, "chat", chat_request(c), ids, c.finish)
    want_msg, want = exact_message(exp.response["choices"][0]["message"]), chat_want(exp)
    body = {**chat_request(c), "n": 3}

    async def go(cl: Client):
        return (await cl.post(CHAT, body, ids, c.finish),
                {"split=1": await cl.post(CHAT, {**body, **STREAM_USAGE}, ids, c.finish, split=1),
                 "one event": await cl.post(CHAT, {**body, **STREAM_USAGE}, ids, c.finish, split=0),
                 "k=7": await cl.post(CHAT, {**body, **STREAM_USAGE}, ids, c.finish, cuts=[7])})

    got, streams = run(st, go)
    assert [ch["index"] for ch in got["choices"]] == [0, 1, 2]
    assert all(exact_message(ch["message"]) == want_msg and ch["finish_reason"] == "tool_calls"
               for ch in got["choices"])
    P, N = len(exp.prompt_ids), 3 * want["completion_tokens"]           # the prompt counts once
    assert got["usage"] == {"prompt_tokens": P, "completion_tokens": N, "total_tokens": P + N,
                            "prompt_tokens_details": {"cached_tokens": 0},
                            "completion_tokens_details": {"reasoning_tokens": 3 * want["reasoning_tokens"]}}
    for how, text in streams.items():
        chunks = chat_chunks(text)
        s = assemble(chunks)
        assert sorted(s) == [0, 1, 2], how
        for i in range(3):
            assert _text_only(stream_summary(s[i])) == _text_only(want), (how, i)
            assert s[i]["roles"] == ["assistant"], (how, i)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == got["usage"], how
        assert all(ch["usage"] is None for ch in chunks[:-1]), how


@pytest.mark.parametrize("name", ["dsml-think", "stop-in-content", "cjk-chat"])
def test_return_token_ids(stack, name):
    """token_ids: every id the backend emitted up to the end of the output, across the chunks of
    each choice (n=2); prompt_token_ids: the prompt the backend got, on each choice's first chunk
    (streamed) / at the top of the response (vLLM's chat shape)."""
    st = stack
    c = _case(name)
    ids = case_ids(st.tok, c)
    exp = recipe(st.rtok, "chat", chat_request(c), ids, c.finish)
    want, used = chat_want(exp), ids[:exp.consumed]
    body = {**chat_request(c), "n": 2, "return_token_ids": True}

    async def go(cl: Client):
        out = {"body": await cl.post(CHAT, body, ids, c.finish)}
        for how, kw in {"split=1": {"split": 1}, "one event": {"split": 0}, "k=3": {"cuts": [3]}}.items():
            out[how] = await cl.post(CHAT, {**body, "stream": True}, ids, c.finish, **kw)
        return out

    out = run(st, go)
    prompt = st.backend.requests[-1].prompt_ids
    assert prompt == exp.prompt_ids
    full = out.pop("body")
    assert full["prompt_token_ids"] == prompt
    for i, ch in enumerate(full["choices"]):
        assert ch["index"] == i and ch["token_ids"] == used and "prompt_token_ids" not in ch
        assert _text_only(summary(ch["message"], ch["finish_reason"], None)) == _text_only(want)
    for how, text in out.items():
        chunks = chat_chunks(text)
        s = assemble(chunks)
        for i in (0, 1):
            assert s[i]["token_ids"] == used, (how, i)
            assert _text_only(stream_summary(s[i])) == _text_only(want), (how, i)
            mine = [ch for ch in chunks if ch["choices"][0]["index"] == i]
            assert mine[0]["prompt_token_ids"] == prompt and "role" in mine[0]["choices"][0]["delta"], (how, i)
            assert all("prompt_token_ids" not in ch for ch in mine[1:]), (how, i)


INCLUDE_STOP = [
    # (corpus case, stop strings, the stop string the recipe matched: content + it is the output)
    ("stop-in-content", None, "END"),
    ("stop-across-tokens", None, "lo wo"),
    ("stop-cjk", None, "世界"),
    ("two-stops-later-first", None, "yy"),
    # one token (" the") completes both stop strings: the recipe stops at the one that ends first
    # ("th"); at the same end, at the first listed. Output "Go th" / "Go the": a prefix of the text
    ("same-token-two-stops", ("th", "e"), "th"),
    ("same-end-shorter-listed-first", ("he", "the"), "he"),
    ("same-end-longer-listed-first", ("the", "he"), "the"),
]


@pytest.mark.parametrize("name,stops,matched", INCLUDE_STOP, ids=[x[0] for x in INCLUDE_STOP])
def test_include_stop_str_in_output_appends_the_matched_stop_string(stack, name, stops, matched):
    st = stack
    c = (_case(name) if stops is None else
         Case(name, "R.</think>Go the way", stop=stops))
    ids = case_ids(st.tok, c)
    exp = recipe(st.rtok, "chat", chat_request(c), ids, c.finish)
    want = chat_want(exp)
    assert want["finish"] == "stop" and exp.consumed < len(ids)            # a stop string ended it
    mb = {"model": MODEL, "messages": chat_request(c)["messages"], "max_tokens": 100, "stop_sequences": list(c.stop),
          "thinking": {"type": "enabled" if c.think else "disabled"}}
    assert recipe(st.rtok, "messages", mb, ids, c.finish).response["stop_sequence"] == matched
    want = {**want, "content": want["content"] + matched}
    body = {**chat_request(c), "include_stop_str_in_output": True}

    async def go(cl: Client):
        return (await cl.post(CHAT, body, ids, c.finish),
                [await cl.post(CHAT, {**body, **STREAM_USAGE}, ids, c.finish, split=sp) for sp in (1, 0)])

    got, streams = run(st, go)
    assert body_summary(got) == want
    for text in streams:
        assert stream_summary(assemble(chat_chunks(text))[0]) == want


def test_include_stop_str_in_output_final_stop_token(stack):
    """The final stop token's text is output only with include_stop_str_in_output: a stop token
    from stop_token_ids always, EOS only when skip_special_tokens is off (vLLM)."""
    st = stack
    bang = st.tok.encode("!")
    assert len(bang) == 1
    ids = st.tok.encode("R.</think>Yes") + bang                       # stopped by stop_token_ids=[!]
    base = {**chat_request(Case("stop-token", "")), "stop_token_ids": bang}
    plain = recipe(st.rtok, "chat", base, ids, "stop")                        # "!" counted, not output
    shown = recipe(st.rtok, "chat", base, ids, "stop", blank=set())          # "!" output
    assert body_summary(plain.response)["content"] == "Yes" and body_summary(shown.response)["content"] == "Yes!"
    eos_ids = st.tok.encode("R.</think>Yes") + [st.tok.eos_id]
    eos_plain = recipe(st.rtok, "chat", base, eos_ids, "stop")
    eos_shown = recipe(st.rtok, "chat", base, eos_ids, "stop", blank=set())
    assert body_summary(eos_shown.response)["content"] == "Yes" + EOS_TEXT
    runs = [  # (request extras, ids, the reference)
        ({}, ids, plain), ({"include_stop_str_in_output": True}, ids, shown),
        ({"include_stop_str_in_output": True}, eos_ids, eos_plain),
        ({"include_stop_str_in_output": True, "skip_special_tokens": False}, eos_ids, eos_shown),
        ({"skip_special_tokens": False}, eos_ids, eos_plain),
    ]

    async def go(cl: Client):
        out = []
        for extra, i, _ in runs:
            b = {**base, **extra}
            out.append((await cl.post(CHAT, b, i, "stop"),
                        await cl.post(CHAT, {**b, **STREAM_USAGE}, i, "stop", split=0)))
        return out

    for (extra, _, ref), (got, text) in zip(runs, run(st, go)):
        want = chat_want(ref)
        assert body_summary(got) == want, extra
        assert stream_summary(assemble(chat_chunks(text))[0]) == want, extra


def test_usage_chunks(stack):
    """No stream_options: no usage anywhere. include_usage: exactly one last chunk, empty choices,
    the non-streamed usage; null usage on every other chunk. continuous_usage_stats: usage on
    every chunk, completion_tokens = the ids returned so far."""
    st = stack
    c = _case("dsml-think")
    ids = case_ids(st.tok, c)
    body = chat_request(c)

    async def go(cl: Client):
        return (await cl.post(CHAT, {**body, "n": 2}, ids, c.finish),
                await cl.post(CHAT, {**body, "n": 2, "stream": True}, ids, c.finish),
                await cl.post(CHAT, {**body, "n": 2, **STREAM_USAGE}, ids, c.finish, cuts=[5, 9]),
                await cl.post(CHAT, {**body, "stream": True, "return_token_ids": True,
                                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                              ids, c.finish, cuts=[2, 3, 10, 40]),
                await cl.post(CHAT, body, ids, c.finish))

    got2, none, last, cont, got1 = run(st, go)
    chunks = chat_chunks(none)
    assert all(ch.get("usage") is None and ch["choices"] for ch in chunks)
    chunks = chat_chunks(last)
    assert [ch for ch in chunks if not ch["choices"]] == [chunks[-1]]
    assert chunks[-1]["usage"] == got2["usage"] and all(ch["usage"] is None for ch in chunks[:-1])
    chunks = chat_chunks(cont)
    P, seen = got1["usage"]["prompt_tokens"], 0
    for ch in chunks[:-1]:
        seen += len(ch["choices"][0]["token_ids"])
        u = ch["usage"]
        assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (P, seen, P + seen), ch
    assert seen == len(ids) and chunks[-1]["choices"] == [] and chunks[-1]["usage"] == got1["usage"]
    assert chunks[-2]["usage"] == got1["usage"]          # the finish chunk: the whole usage


@pytest.mark.parametrize("finish", ["length", "stop"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
def test_skip_special_tokens_with_eos_and_bos_mid_output(stack, skip, finish):
    """ignore_eos: EOS (and BOS) met mid-output are counted; with skip_special_tokens (the
    default) their text is not output, as vLLM's detokenizer skips it; without, the recipe
    gets their text."""
    st = stack
    tok = st.tok
    ids = (tok.encode("Thinking") + [tok.eos_id] + tok.encode(" more.</think>A") + [tok.eos_id] + tok.encode(" B")
           + [tok.bos_id] + tok.encode(" C") + ([tok.eos_id] if finish == "stop" else []))
    special = {k for k, t in enumerate(ids) if t in (tok.eos_id, tok.bos_id)}
    last = {len(ids) - 1} if finish == "stop" else set()
    body = chat_request(Case("ignore-eos", ""))
    exp = recipe(st.rtok, "chat", body, ids, finish, blank=special | last if skip else last)
    want = chat_want(exp)
    if skip:
        assert (want["reasoning"], want["content"]) == ("Thinking more.", "A B C")
    else:
        assert EOS_TEXT in want["content"] + want["reasoning"]
    req = {**body, "ignore_eos": True, "skip_special_tokens": skip}

    async def go(cl: Client):
        return (await cl.post(CHAT, req, ids, finish),
                [await cl.post(CHAT, {**req, **STREAM_USAGE}, ids, finish, **kw) for kw in
                 ({"split": 1}, {"split": 0}, {"cuts": [len(ids) // 2]})])

    got, streams = run(st, go)
    assert exact_message(got["choices"][0]["message"]) == exact_message(exp.response["choices"][0]["message"])
    assert body_summary(got) == want
    for text in streams:
        assert stream_summary(assemble(chat_chunks(text))[0]) == want


@pytest.mark.parametrize("name", ["think-basic", "dsml-think", "cjk-chat", "stop-in-content"])
def test_logprobs_equal_recipe(stack, name):
    """Backend logprobs (one Sampled per id) reach the recipe, which places them per channel
    (content / reasoning_content); the final stop token's are dropped with its text."""
    st = stack
    c = _case(name)
    ids = case_ids(st.tok, c)
    sampled = [Sampled(t, -0.01 * (k + 1), [(t, -0.01 * (k + 1)), (7, -5.0 - k)]) for k, t in enumerate(ids)]
    lps = [(s.logprob, list(s.top_logprobs)) for s in sampled]
    body = {**chat_request(c), "logprobs": True, "top_logprobs": 2}
    exp = recipe(st.rtok, "chat", body, ids, c.finish, logprobs=lps)
    want_lp = exp.response["choices"][0]["logprobs"]
    assert want_lp and sum(map(len, want_lp.values())) >= 3

    async def go(cl: Client):
        return (await cl.post(CHAT, body, ids, c.finish, split=1, logprobs=sampled),
                [await cl.post(CHAT, {**body, **STREAM_USAGE}, ids, c.finish, split=sp, logprobs=sampled)
                 for sp in (1, 0)]
                + [await cl.post(CHAT, {**body, **STREAM_USAGE}, ids, c.finish, cuts=[4], logprobs=sampled)])

    got, streams = run(st, go)
    assert st.backend.requests[-1].params.logprobs == 2
    assert got["choices"][0]["logprobs"] == want_lp
    assert body_summary(got) == chat_want(exp)
    for text in streams:
        s = assemble(chat_chunks(text))[0]
        assert s["logprobs"] == {k: v for k, v in want_lp.items() if v}
        assert stream_summary(s) == chat_want(exp)


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_responses_and_messages_never_output_eos_text(stack, api):
    """/v1/responses and /v1/messages accept vLLM's ``ignore_eos`` (an extra field; the sampler
    honours it), so EOS can occur mid-output there too. Its text must not reach the output:
    vLLM's skip_special_tokens default, as on /v1/chat/completions. Either the request must not
    ask the backend to ignore EOS, or the output is the recipe's with EOS counted without text."""
    st = stack
    tok = st.tok
    ids = tok.encode("R.</think>A") + [tok.eos_id] + tok.encode(" B") + [tok.eos_id]
    body = ({"model": MODEL, "input": "hi", "ignore_eos": True} if api == "responses" else
            {"model": MODEL, "messages": _MSG, "max_tokens": 100, "ignore_eos": True})
    recipe_body = {k: v for k, v in body.items() if k != "ignore_eos"}
    exp = recipe(st.rtok, api, recipe_body, ids, "stop", blank={ids.index(tok.eos_id), len(ids) - 1})
    path = "/v1/responses" if api == "responses" else "/v1/messages"

    async def go(cl: Client):
        return (await cl.post(path, body, ids, "stop"),
                await cl.post(path, {**body, "stream": True}, ids, "stop", split=0))

    got, text = run(st, go)
    if not st.backend.requests[-1].params.ignore_eos:
        return                      # the backend stops at EOS: no EOS mid-output can occur
    for how, out in (("body", json.dumps(got, ensure_ascii=False)), ("stream", text)):
        i = out.find(EOS_TEXT)
        assert i < 0, f"{how}: EOS text in the output: ...{out[max(0, i - 60):i + 40]}..."
    assert normalise(got, got["id"]) == normalise(exp.response, "RID")
