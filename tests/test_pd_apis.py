"""The four APIs through real ``launch-pd`` processes (prefill worker, decode worker, gateway), with
the real ``openai`` and ``anthropic`` SDKs: Chat Completions (sync, async, streamed, n=3; thinking on
by default and off), Completions, Responses (``create`` and streamed) and Anthropic Messages
(``create`` and ``stream``; tools, thinking on / off, errors, ``x-api-key``).

Expected values are computed apart from the gateway: prompt ids by DeepSeek's format library
(``deepseek_recipe``: convert the same body, encode the conversation), output ids by the in-process
engine (greedy), and output text / events by feeding those ids to the recipe's own
``StreamProcessor`` (built with the response id the gateway answered with, so whole response objects
compare equal; only clock fields are dropped). The random model never ends by itself within a few
tokens, so every sample ends by length: ``finish_reason`` "length", Responses ``incomplete``
(max_output_tokens), Messages ``stop_reason`` "max_tokens". In thinking mode it never writes
``</think>``, so all its text is reasoning.

Usage must count every generated token, also when the length limit cuts a character in two (its
first bytes are held back from the text): ``test_usage_counts_the_tokens_of_a_character_the_limit_cut``.

One stack serves the whole module (starting processes is the expensive part); the in-process
engine computes every case in one batched run. Every completion token a test receives goes into a
ledger; the last test checks the gateway's ``dsv4:generation_tokens_total`` moved by exactly the
ledger's sum.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re

import anthropic
import deepseek_recipe as dr
import httpx
import openai
import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from pd_util import start_pd, wait_idle
from serve_util import reasoning_from_ids, set_reasoning_usage

MODEL = "deepseek_v4"
KEY = "test-key-pd-apis"
LENGTH = dr.InferenceFinishReason.Length
# clock fields: the gateway's and the recipe's clocks read different seconds
CLOCK = frozenset({"created", "created_at", "completed_at"})
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
THINK_OFF = {"type": "disabled"}
THINK_ON = {"type": "enabled", "budget_tokens": 1024}
# Anthropic's stream events (the SDK's helper adds "text" / "thinking" / "signature" events of its own)
_WIRE_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                "message_delta", "message_stop"}
# the cases (text, output tokens); ``_cases`` lists them all for one batched reference run
CHAT_SYNC = ("Name a colour.", 8)
CHAT_ASYNC = [("Count to three.", True), ("Count to three.", False), ("Say a word. " * 20, True)]
CHAT_ASYNC_N = 6
CHAT_STREAM = ("Name an animal.", 7)
CHAT_N3 = ("Pick a number.", 5)
COMPLETION = ("The capital of France is", 9)
RESPONSES_CREATE_N, RESPONSES_STREAM_N = 8, 6
MESSAGES_CREATE_N, MESSAGES_STREAM_N = 8, 8
MESSAGES_STREAM = [(True, True), (False, False)]      # (thinking, tools)
# conversations all three chat APIs render alike, whose greedy output cut at n tokens ends inside a
# character (its last tokens are the first bytes of one): (system, user, n, thinking)
PARTIAL = {"answer": ("You answer in one word.", "What is the weather in Paris?", 7, False),
           "reasoning": ("You are terse.", "Name an animal.", 13, True)}


# ---- the stack, the references --------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(ckpt, tmp_path_factory):
    """One prefill, one decode, one gateway (``--api-key``); ``stack.ledger``: completion tokens received,
    ``stack.gen0``: the gateway's generation_tokens_total before any request."""
    log = tmp_path_factory.mktemp("pd-apis") / "pd.log"
    pd = start_pd(ckpt, log, instance_args={"gateway": ["--api-key", KEY]})
    pd.ledger = []
    pd.gen0 = _generation_tokens(pd)
    yield pd
    pd.stop()


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(stack):
    return anthropic.Anthropic(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=120)


class Recipe:
    """DeepSeek's format library used directly (not through server/): conversion, prompt encoding
    and the stream processor, configured as the gateway says it is (served name -> V4 encoding,
    thinking on by default)."""

    REQ = {"chat": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest, "messages": dr.MessagesRequest}
    RESP = {"chat": dr.ChatCompletionResponse, "responses": dr.ResponsesResponse, "messages": dr.MessagesResponse}

    def __init__(self, ckpt: str):
        self.tok = dr.Tokenizer.from_file(f"{ckpt}/tokenizer.json")
        self.opts = (dr.ConversionOptions(default_thinking_mode=True)
                     .with_model_versions_by_name({MODEL: dr.ModelVersion.DeepseekV4Pro}))
        self.enc = dr.DeepseekV4Encoding().with_tokenizer(self.tok)

    def _convert(self, api: str, body: dict):
        req = self.REQ[api](body)
        echo = req.echo() if api == "responses" else None
        return req.convert(self.opts), echo

    def prompt_ids(self, api: str, body: dict) -> list[int]:
        return self.enc.encode(self._convert(api, body)[0].conversation)

    def _process(self, api: str, body: dict, ids: list[int], rid: str) -> tuple[list, int]:
        """(the recipe's chunk / event objects, prompt tokens) for output ``ids`` ending by length,
        one token a chunk (as the gateway feeds them)."""
        cr, echo = self._convert(api, body)
        gen = self.REQ[api].chunk_generator(cr, rid, MODEL)
        if echo is not None:
            gen = gen.with_echo(echo)
        proc = dr.StreamProcessor(gen, cr.parsing_options, self.tok)
        n_prompt = len(self.enc.encode(cr.conversation))
        out = proc.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=n_prompt)))
        for t in ids:
            out += proc.push(dr.InferenceChunk.tokens([t]))
        out += proc.push(dr.InferenceChunk.finish(LENGTH))
        po = cr.parsing_options
        stage = po.thinking_initial_stage
        starts = stage is not None and stage.starts_in_reasoning() and not po.starts_in_tool_calls
        return out + proc.finish(), n_prompt, reasoning_from_ids(ids, starts)

    def events(self, api: str, body: dict, ids: list[int], rid: str) -> list[dict]:
        """The recipe's chunks / events (JSON) for output ``ids``, reasoning tokens counted from the ids."""
        out, _, n_reason = self._process(api, body, ids, rid)
        return [set_reasoning_usage(json.loads(e.to_json()), n_reason) for e in out]

    def response(self, api: str, body: dict, ids: list[int], rid: str) -> dict:
        """The recipe's accumulated response object for output ``ids`` (clock fields dropped),
        reasoning tokens counted from the ids (the gateway's rule)."""
        out, n_prompt, n_reason = self._process(api, body, ids, rid)
        acc = self.RESP[api](rid, MODEL, 0, n_prompt, 0)
        for e in out:
            acc.accumulate(e)
        return _noclock(set_reasoning_usage(json.loads(acc.to_json()), n_reason))


@pytest.fixture(scope="module")
def recipe(ckpt) -> Recipe:
    return Recipe(ckpt)


@contextlib.contextmanager
def _one_thread():
    """The in-process engine on one thread while it runs: the worker processes hold the other cores
    (oversubscribed OpenMP threads spin and stall each other)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def greedy(reference, recipe, ckpt):
    """greedy(prompt ids, n) -> the in-process engine's greedy output ids. Every case of this module
    (``_cases``) runs in one batched ``generate`` up front (the engine's output does not depend on the
    batch: tests/test_batched_decode.py); any other is run alone when asked. Each case is chosen so
    the random model does not end by itself (n ids: the sample ends by length)."""
    cache: dict = {}

    def run(cases) -> None:
        todo = list(dict.fromkeys((tuple(p), n) for p, n in cases if (tuple(p), n) not in cache))
        if not todo:
            return
        with _one_thread():
            seqs = reference.generate([list(p) for p, _ in todo],
                                      [SamplingParams(max_new_tokens=n, temperature=0) for _, n in todo])
        for key, seq in zip(todo, seqs):
            assert len(seq.output_ids) == key[1], "the random model ended early: pick another prompt"
            cache[key] = seq.output_ids

    run(_cases(recipe, Tokenizer(ckpt).bos_id))

    def get(prompt: list[int], n: int) -> list[int]:
        run([(prompt, n)])
        return cache[(tuple(prompt), n)]
    return get


def _noclock(x):
    if isinstance(x, dict):
        return {k: _noclock(v) for k, v in x.items() if k not in CLOCK}
    if isinstance(x, list):
        return [_noclock(v) for v in x]
    return x


def _dump(model) -> dict:
    """An SDK object as the JSON it was built from (fields the server sent), clock fields dropped."""
    return _noclock(model.model_dump(mode="json", exclude_unset=True))


def _generation_tokens(pd) -> float:
    text = httpx.get(pd.metrics_urls["gateway"], timeout=10).text
    m = re.search(r'^dsv4:generation_tokens_total\{model_name="deepseek_v4"\} (\S+)$', text, re.M)
    assert m, "dsv4:generation_tokens_total{model_name=\"deepseek_v4\"} missing from the gateway's /metrics"
    return float(m.group(1))


def _chat_body(content: str, n_tokens: int, thinking: bool) -> dict:
    body = {"model": MODEL, "messages": [{"role": "system", "content": "You are terse."},
                                         {"role": "user", "content": content}],
            "max_tokens": n_tokens, "temperature": 0}
    if not thinking:
        body["thinking"] = THINK_OFF
    return body


def _chat_kwargs(body: dict, **extra_body) -> dict:
    """openai SDK kwargs for a recipe body (``thinking`` is not an SDK argument: extra_body)."""
    kw = {k: v for k, v in body.items() if k != "thinking"}
    eb = dict(extra_body)
    if "thinking" in body:
        eb["thinking"] = body["thinking"]
    return {**kw, "extra_body": eb}


def _expect_message(recipe, body, ids, rid) -> dict:
    return recipe.response("chat", body, ids, rid)["choices"][0]["message"]


# ---- models, served name ---------------------------------------------------------------------------
def test_models_lists_the_served_name_and_workers_label_it(stack, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    for name, url in stack.metrics_urls.items():
        text = httpx.get(url, timeout=10).text
        labels = set(re.findall(r'model_name="([^"]*)"', text))
        assert labels == {MODEL}, (name, labels)
        assert re.search(r'^dsv4:generation_tokens_total\{[^}]*model_name="deepseek_v4"', text, re.M), name


def test_wrong_key_is_401_in_each_apis_shape(stack):
    bad = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    bad_a = anthropic.Anthropic(base_url=stack.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad_a.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "invalid or missing API key"}}


# ---- chat completions ------------------------------------------------------------------------------
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_chat_sync_equals_engine_and_recipe(stack, oai, recipe, greedy, thinking):
    n = CHAT_SYNC[1]
    body = _chat_body(CHAT_SYNC[0], n, thinking)
    r = oai.chat.completions.create(**_chat_kwargs(body, return_token_ids=True))
    stack.ledger.append(r.usage.completion_tokens)
    ch = r.choices[0]
    prompt = recipe.prompt_ids("chat", body)
    want = greedy(prompt, n)
    assert r.model_extra["prompt_token_ids"] == prompt             # vLLM: top-level in a chat response
    assert ch.model_extra["token_ids"] == want
    msg = _expect_message(recipe, body, want, r.id)
    assert ch.message.content == msg.get("content")
    assert getattr(ch.message, "reasoning_content", None) == msg.get("reasoning_content")
    if thinking:
        assert ch.message.content == "" and ch.message.reasoning_content     # no </think>: all reasoning
    else:
        assert ch.message.content and msg.get("reasoning_content") is None
    assert ch.finish_reason == "length" and ch.message.tool_calls is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), n)
    details = r.usage.completion_tokens_details
    assert (details.reasoning_tokens if details else None) == (n if thinking else None)


def test_chat_async_concurrent_equals_engine(stack, recipe, greedy):
    n = CHAT_ASYNC_N
    bodies = [_chat_body(text, n, thinking) for text, thinking in CHAT_ASYNC]

    async def run():
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(client.chat.completions.create(**_chat_kwargs(b, return_token_ids=True))
                                          for b in bodies))
        finally:
            await client.close()
    results = asyncio.run(run())
    stack.ledger.extend(r.usage.completion_tokens for r in results)
    for body, r in zip(bodies, results):
        prompt = recipe.prompt_ids("chat", body)
        want = greedy(prompt, n)
        ch = r.choices[0]
        assert r.model_extra["prompt_token_ids"] == prompt
        assert ch.model_extra["token_ids"] == want
        msg = _expect_message(recipe, body, want, r.id)
        assert (ch.message.content, getattr(ch.message, "reasoning_content", None)) == \
            (msg.get("content"), msg.get("reasoning_content"))
        assert r.usage.completion_tokens == n
    assert len({tuple(r.model_extra["prompt_token_ids"]) for r in results}) == 3


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_chat_stream_equals_engine_and_recipe(stack, oai, recipe, greedy, thinking):
    n = CHAT_STREAM[1]
    body = _chat_body(CHAT_STREAM[0], n, thinking)
    chunks = list(oai.chat.completions.create(**_chat_kwargs(body, return_token_ids=True), stream=True,
                                              stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    stack.ledger.append(usage.completion_tokens)
    prompt = recipe.prompt_ids("chat", body)
    want = greedy(prompt, n)
    ids, content, reasoning, finish = [], "", "", []
    for c in chunks[:-1]:
        assert c.usage is None and len(c.choices) == 1 and c.choices[0].index == 0
        d = c.choices[0].delta
        ids += c.choices[0].model_extra.get("token_ids") or []
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        finish += [c.choices[0].finish_reason] if c.choices[0].finish_reason else []
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    assert chunks[-1].choices == [] and len({c.id for c in chunks}) == 1
    assert ids == want
    msg = _expect_message(recipe, body, want, chunks[0].id)
    assert content == (msg.get("content") or "")
    assert reasoning == (msg.get("reasoning_content") or "")
    assert bool(reasoning) == thinking and bool(content) != thinking
    assert finish == ["length"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), n)


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_chat_n3_greedy_choices_all_equal_engine(stack, oai, recipe, greedy, stream):
    n = CHAT_N3[1]
    body = _chat_body(CHAT_N3[0], n, True)
    kw = dict(_chat_kwargs(body, return_token_ids=True), n=3)
    prompt = recipe.prompt_ids("chat", body)
    want = greedy(prompt, n)
    if not stream:
        r = oai.chat.completions.create(**kw)
        stack.ledger.append(r.usage.completion_tokens)
        assert [c.index for c in r.choices] == [0, 1, 2] and r.model_extra["prompt_token_ids"] == prompt
        msg = _expect_message(recipe, body, want, r.id)
        for c in r.choices:
            assert c.model_extra["token_ids"] == want
            assert (c.message.content, c.message.reasoning_content) == (msg["content"], msg["reasoning_content"])
            assert c.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 3 * n)
        assert r.usage.completion_tokens_details.reasoning_tokens == 3 * n
        return
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    stack.ledger.append(usage.completion_tokens)
    ids, reasoning, finish = {}, {}, {}
    for c in chunks[:-1]:
        for ch in c.choices:
            ids.setdefault(ch.index, []).extend(ch.model_extra.get("token_ids") or [])
            reasoning[ch.index] = reasoning.get(ch.index, "") + (getattr(ch.delta, "reasoning_content", None) or "")
            if ch.finish_reason:
                finish[ch.index] = finish.get(ch.index, []) + [ch.finish_reason]
    msg = _expect_message(recipe, body, want, chunks[0].id)
    assert ids == {0: want, 1: want, 2: want}
    assert reasoning == {i: msg["reasoning_content"] for i in range(3)}
    assert finish == {i: ["length"] for i in range(3)}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 3 * n)


# ---- completions -------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_completions_text_prompt_max_completion_tokens(stack, oai, recipe, greedy, ckpt, stream):
    text, n = COMPLETION                        # n: not the endpoint's default of 16
    tok = Tokenizer(ckpt)
    prompt = [tok.bos_id] + recipe.tok.encode(text)
    want = greedy(prompt, n)
    kw = dict(model=MODEL, prompt=text, temperature=0,
              extra_body={"max_completion_tokens": n, "return_token_ids": True})
    if not stream:
        r = oai.completions.create(**kw)
        stack.ledger.append(r.usage.completion_tokens)
        c = r.choices[0]
        got_ids, got_prompt, got_text, finish, usage = (c.model_extra["token_ids"], c.model_extra["prompt_token_ids"],
                                                        c.text, [c.finish_reason], r.usage)
    else:
        chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        stack.ledger.append(usage.completion_tokens)
        got_ids = [t for c in chunks[:-1] for ch in c.choices for t in ch.model_extra.get("token_ids") or []]
        got_text = "".join(ch.text for c in chunks[:-1] for ch in c.choices)
        finish = [ch.finish_reason for c in chunks[:-1] for ch in c.choices if ch.finish_reason]
        got_prompt = prompt                     # a streamed completion carries no prompt ids
    assert got_prompt == prompt
    assert got_ids == want
    assert got_text == tok.decode(want, skip_special_tokens=True)
    assert finish == ["length"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), n)


# ---- responses ---------------------------------------------------------------------------------
def _responses_body(n: int, thinking: bool) -> dict:
    body = {"model": MODEL, "input": "Describe the sea in one sentence.", "instructions": "Be brief.",
            "max_output_tokens": n, "temperature": 0}
    if not thinking:
        body["reasoning"] = {"effort": "none"}
    return body


def _output_texts(output: list[dict]) -> tuple[str, str]:
    """(output text, reasoning text) of Responses output items (JSON)."""
    text = "".join(p["text"] for o in output if o["type"] == "message" for p in o["content"]
                   if p["type"] == "output_text")
    reasoning = "".join(p["text"] for o in output if o["type"] == "reasoning" for p in o.get("content") or []
                        if p["type"] == "reasoning_text")
    return text, reasoning


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_responses_create_equals_recipe_of_engine_ids(stack, oai, recipe, greedy, thinking):
    n = RESPONSES_CREATE_N
    body = _responses_body(n, thinking)
    raw = oai.responses.with_raw_response.create(**body)
    r = raw.parse()
    stack.ledger.append(r.usage.output_tokens)
    prompt = recipe.prompt_ids("responses", body)
    want = greedy(prompt, n)
    expected = recipe.response("responses", body, want, r.id)
    assert _noclock(raw.http_response.json()) == expected
    text, reasoning = _output_texts(expected["output"])
    assert r.output_text == text
    assert _output_texts(_dump(r)["output"]) == (text, reasoning)
    assert bool(reasoning) == thinking and bool(text) != thinking
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(prompt), n)
    assert r.usage.output_tokens_details.reasoning_tokens == (n if thinking else 0)


@pytest.mark.parametrize("how", ["create-stream", "stream-helper"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_responses_stream_events_equal_recipe_of_engine_ids(stack, oai, recipe, greedy, thinking, how):
    n = RESPONSES_STREAM_N
    body = _responses_body(n, thinking)
    if how == "create-stream":
        events = list(oai.responses.create(**body, stream=True))
    else:
        # the helper's get_final_response() needs response.completed; a length-ended response is
        # `incomplete`, so only its events are read
        with oai.responses.stream(**body) as s:
            events = list(s)
    final = events[-1].response
    stack.ledger.append(final.usage.output_tokens)
    prompt = recipe.prompt_ids("responses", body)
    want = greedy(prompt, n)
    expected = recipe.events("responses", body, want, events[0].response.id)
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.incomplete"
    assert types == [e["type"] for e in expected]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # the helper adds fields of its own (the text so far: "snapshot", "parsed"); the rest is the wire's
    assert [{k: v for k, v in _dump(e).items() if k not in ("snapshot", "parsed")} for e in events] == \
        [_noclock(e) for e in expected]
    delta = "response.output_text.delta" if not thinking else "response.reasoning_text.delta"
    text = "".join(e.delta for e in events if e.type == delta)
    assert text and text == "".join(_output_texts(_noclock(expected[-1]["response"]["output"])))
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (len(prompt), n)


# ---- anthropic messages -------------------------------------------------------------------------
def _messages_body(n: int, thinking: bool, tools: bool) -> dict:
    body = {"model": MODEL, "max_tokens": n, "system": "You answer in one word.",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "thinking": THINK_ON if thinking else THINK_OFF}
    if tools:
        body["tools"] = [WEATHER]
    return body


def _messages_kwargs(body: dict) -> dict:
    # anthropic 2.x's messages.create has no temperature argument: extra_body
    return {**body, "extra_body": {"temperature": 0}}


def _messages_expected(recipe, greedy, body):
    rbody = {**body, "temperature": 0}
    prompt = recipe.prompt_ids("messages", rbody)
    want = greedy(prompt, body["max_tokens"])
    return prompt, want, rbody


@pytest.mark.parametrize("tools", [True, False], ids=["tools", "no-tools"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_messages_create_equals_recipe_of_engine_ids(stack, ant, recipe, greedy, thinking, tools):
    n = MESSAGES_CREATE_N
    body = _messages_body(n, thinking, tools)
    raw = ant.messages.with_raw_response.create(**_messages_kwargs(body))
    m = raw.parse()
    stack.ledger.append(m.usage.output_tokens)
    prompt, want, rbody = _messages_expected(recipe, greedy, body)
    expected = recipe.response("messages", rbody, want, m.id)
    assert raw.http_response.json() == expected
    kinds = [b.type for b in m.content]
    assert kinds == (["thinking"] if thinking else ["text"])
    got = m.content[0].thinking if thinking else m.content[0].text
    want_block = expected["content"][0]
    assert got and got == want_block["thinking" if thinking else "text"]
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (len(prompt), n)
    assert m.model == MODEL and m.role == "assistant"


def test_messages_tools_change_the_prompt(recipe):
    """The tool definitions reach the rendered prompt (so the tools cases above test another prompt)."""
    with_tools = recipe.prompt_ids("messages", {**_messages_body(4, False, True), "temperature": 0})
    without = recipe.prompt_ids("messages", {**_messages_body(4, False, False), "temperature": 0})
    assert len(with_tools) > len(without) + 10


@pytest.mark.parametrize("thinking,tools", MESSAGES_STREAM, ids=["thinking-tools", "plain"])
def test_messages_stream_equals_recipe_of_engine_ids(stack, ant, recipe, greedy, thinking, tools):
    n = MESSAGES_STREAM_N
    body = _messages_body(n, thinking, tools)
    with ant.messages.stream(**_messages_kwargs(body)) as s:
        events = [e for e in s if e.type in _WIRE_EVENTS]      # the helper adds its own "text" / "thinking"
        final = s.get_final_message()
    stack.ledger.append(final.usage.output_tokens)
    prompt, want, rbody = _messages_expected(recipe, greedy, body)
    # the SDK drops "ping" events (the recipe sends one after the first content_block_start)
    expected = [e for e in recipe.events("messages", rbody, want, final.id) if e["type"] != "ping"]
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert types == [e["type"] for e in expected]
    # the helper adds snapshots of its own to the stop events; the rest is the wire's
    own = {"content_block_stop": "content_block", "message_stop": "message"}
    assert [{k: v for k, v in _dump(e).items() if k != own.get(e.type)} for e in events] == expected
    message = _dump(final)
    assert message.pop("stop_details", None) is None          # the helper copies it from message_delta
    assert message == recipe.response("messages", rbody, want, final.id)
    assert final.stop_reason == "max_tokens"
    assert [b.type for b in final.content] == (["thinking"] if thinking else ["text"])
    assert (final.usage.input_tokens, final.usage.output_tokens) == (len(prompt), n)


def test_errors_have_each_apis_shape(oai, ant):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:                  # OpenAI's shape on /v1/responses
        oai.responses.create(model="gpt-nope", input="hi", max_output_tokens=4)
    assert e.value.status_code == 404
    assert e.value.body == {"message": e.value.body["message"], "type": "not_found_error", "param": "model",
                            "code": 404} and "gpt-nope" in e.value.body["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        ant.messages.create(model="claude-nope", max_tokens=4, messages=msgs)
    assert e.value.status_code == 404
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert "claude-nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):                 # streamed: refused before the headers
        with ant.messages.stream(model="claude-nope", max_tokens=4, messages=msgs) as s:
            list(s)
    for bad in ({"max_tokens": 0, "messages": msgs},                        # pydantic: max_tokens >= 1
                {"max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}):   # the recipe refuses
        with pytest.raises(anthropic.BadRequestError) as e:
            ant.messages.create(model=MODEL, **bad)
        assert e.value.status_code == 400
        assert set(e.value.body) == {"type", "error"} and e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "invalid_request_error" and e.value.body["error"]["message"]


# ---- usage when the length limit cuts a character ----------------------------------------------------
def _partial_bodies(case: str) -> dict[str, dict]:
    """The conversation ``PARTIAL[case]`` (greedy) as each API's body."""
    system, user, n, thinking = PARTIAL[case]
    chat = {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": n, "temperature": 0}
    responses = {"model": MODEL, "instructions": system, "input": user, "max_output_tokens": n, "temperature": 0}
    messages = {"model": MODEL, "system": system, "messages": [{"role": "user", "content": user}], "max_tokens": n,
                "temperature": 0, "thinking": THINK_ON if thinking else THINK_OFF}
    if not thinking:
        chat["thinking"], responses["reasoning"] = THINK_OFF, {"effort": "none"}
    return {"chat": chat, "responses": responses, "messages": messages}


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize("case", list(PARTIAL))
def test_usage_counts_the_tokens_of_a_character_the_limit_cut(stack, oai, ant, recipe, greedy, ckpt, case, api,
                                                              stream):
    """The greedy output ends with the first bytes of a character (the length limit cut it): its text
    ends before them (the recipe holds incomplete UTF-8 back, as vLLM's detokenizer does), but usage
    counts every token generated (reasoning tokens too, in thinking mode): the client was limited by,
    and the gateway's metrics count, all n of them."""
    _, _, n, thinking = PARTIAL[case]
    bodies = _partial_bodies(case)
    body = bodies[api]
    prompt = recipe.prompt_ids(api, body)
    assert all(recipe.prompt_ids(a, b) == prompt for a, b in bodies.items())
    want = greedy(prompt, n)
    assert Tokenizer(ckpt).decode(want).endswith("\ufffd")        # the case: the last ids cut a character
    block = recipe.response("messages", bodies["messages"], want, "msg_0")["content"][0]
    text_want = block["thinking" if thinking else "text"]
    g0 = _generation_tokens(stack)
    reasoning = None                                               # reasoning tokens reported (thinking)
    if api == "chat":
        kw = _chat_kwargs(body, return_token_ids=True)
        if stream:
            chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            u = chunks[-1].usage
            text = "".join((getattr(c.choices[0].delta, "reasoning_content" if thinking else "content", None) or "")
                           for c in chunks[:-1])
            ids = [t for c in chunks[:-1] for t in c.choices[0].model_extra.get("token_ids") or []]
        else:
            r = oai.chat.completions.create(**kw)
            u, ids = r.usage, r.choices[0].model_extra["token_ids"]
            text = r.choices[0].message.reasoning_content if thinking else r.choices[0].message.content
        assert ids == want
        used = u.completion_tokens
        reasoning = u.completion_tokens_details.reasoning_tokens if thinking else None
    elif api == "responses":
        r = (list(oai.responses.create(**body, stream=True))[-1].response if stream
             else oai.responses.create(**body))
        used = r.usage.output_tokens
        reasoning = r.usage.output_tokens_details.reasoning_tokens if thinking else None
        text = _output_texts(_dump(r)["output"])[1 if thinking else 0]
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        kw = _messages_kwargs({k: v for k, v in body.items() if k != "temperature"})
        if stream:
            with ant.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = ant.messages.create(**kw)
        used = m.usage.output_tokens
        text = m.content[0].thinking if thinking else m.content[0].text
        assert m.stop_reason == "max_tokens"
    delta = _generation_tokens(stack) - g0
    stack.ledger.append(delta)        # this request's usage is what is under test here: the ledger takes
    assert delta == n                 # the gateway's count, checked against the engine's
    assert text == text_want
    assert used == n, f"{api} usage counts {used} of the {n} tokens generated"
    if thinking and api != "messages":
        assert reasoning == n, f"{api} usage counts {reasoning} of the {n} reasoning tokens generated"


def _cases(recipe: "Recipe", bos_id: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) of every request this module compares with the engine."""
    chat = [(_chat_body(CHAT_SYNC[0], CHAT_SYNC[1], t), CHAT_SYNC[1]) for t in (True, False)]
    chat += [(_chat_body(text, CHAT_ASYNC_N, t), CHAT_ASYNC_N) for text, t in CHAT_ASYNC]
    chat += [(_chat_body(CHAT_STREAM[0], CHAT_STREAM[1], t), CHAT_STREAM[1]) for t in (True, False)]
    chat += [(_chat_body(CHAT_N3[0], CHAT_N3[1], True), CHAT_N3[1])]
    out = [(recipe.prompt_ids("chat", b), n) for b, n in chat]
    out += [([bos_id] + recipe.tok.encode(COMPLETION[0]), COMPLETION[1])]
    out += [(recipe.prompt_ids("responses", _responses_body(n, t)), n)
            for n in (RESPONSES_CREATE_N, RESPONSES_STREAM_N) for t in (True, False)]
    msgs = [(t, tools, MESSAGES_CREATE_N) for t in (True, False) for tools in (True, False)]
    msgs += [(t, tools, MESSAGES_STREAM_N) for t, tools in MESSAGES_STREAM]
    out += [(recipe.prompt_ids("messages", {**_messages_body(n, t, tools), "temperature": 0}), n)
            for t, tools, n in msgs]
    out += [(recipe.prompt_ids("messages", _partial_bodies(c)["messages"]), PARTIAL[c][2]) for c in PARTIAL]
    return out


# ---- metrics (last: it checks the ledger of every test above) ----------------------------------------
def test_generation_tokens_total_moved_by_the_tokens_received(stack, oai, ant):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                    temperature=0)
    stack.ledger.append(r.usage.completion_tokens)
    m = ant.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                            extra_body={"temperature": 0})
    stack.ledger.append(m.usage.output_tokens)
    wait_idle(stack, ["prefill0", "decode0"])
    assert _generation_tokens(stack) - stack.gen0 == sum(stack.ledger)

