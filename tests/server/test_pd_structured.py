"""Structured outputs through real ``launch-pd`` processes (a prefill, a decode and the gateway;
a second cluster runs MTP), with the random tiny model, so only the grammar makes an output valid: json_schema
(40 random schemas, streamed and not), json_object, regex, required and named tool calls, the
``openai`` SDK's parse helpers and LangChain's ``with_structured_output``. Constrained P/D
output, MTP or not, is token for token the in-process next_n 0 engine's; a constraint that does not compile
is a 400 naming the field."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

from pathlib import Path

import jsonschema
import pytest
import yaml
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

from bench.structured_schemas import schemas
from engine.core.grammar import GrammarBackend
from engine.core.sampling_params import SamplingParams
from pd_util import CONFIG, start_pd, wait_idle
from server.gateway.dsformat import DeepSeekFormat
from server.gateway.structured import structural_tag

MTP_CONFIG = "configs/tiny-flash-mtp.yaml"
THINKING_OFF = ["--default-thinking", "disabled"]
MODEL = "deepseek_v4"
NO_THINK = {"thinking": {"type": "disabled"}}
MAX_PD = 32                     # tokens compared P/D vs in-process (a constrained sample may end first)
MSGS = [{"role": "user", "content": "Answer in JSON."}]
FORMAT = jsonschema.FormatChecker()


@FORMAT.checks("ipv4")
def _dotted_quad(value) -> bool:
    """RFC 2673's dotted-quad, which JSON Schema's ipv4 names: leading zeros allowed (Python's
    ``ipaddress``, jsonschema's default check, refuses them)."""
    parts = value.split(".") if isinstance(value, str) else []
    return len(parts) == 4 and all(p.isdigit() and len(p) <= 3 and int(p) <= 255 for p in parts)


class City(BaseModel):
    name: str = Field(max_length=8)
    zone: Literal["north", "south"]


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)
    city: City


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "string", "maxLength": 5}}}}}


@pytest.fixture(scope="module")
def cluster(ckpt, tmp_path_factory):
    """configs/tiny-flash.yaml with batch_size 32 (100 concurrent samples), thinking off by default."""
    d = tmp_path_factory.mktemp("pd-structured")
    run = yaml.safe_load(Path(CONFIG).read_text())
    run["scheduler_config"]["batch_size"] = 32
    (d / "run.yaml").write_text(yaml.safe_dump(run))
    pd = start_pd(ckpt, d / "pd.log", config=str(d / "run.yaml"), instance_args={"gateway": THINKING_OFF})
    yield pd
    pd.stop()


@pytest.fixture(scope="module")
def mtp_cluster(ckpt, tmp_path_factory):
    pd = start_pd(ckpt, tmp_path_factory.mktemp("pd-structured-mtp") / "pd.log", config=MTP_CONFIG,
                  instance_args={"gateway": THINKING_OFF})
    yield pd
    pd.stop()


def _client(pd) -> OpenAI:
    return OpenAI(base_url=pd.base_url + "/v1", api_key="none", max_retries=0)


def _schema_format(schema: dict) -> dict:
    """Not strict: OpenAI's strict mode needs every property of every object required (the recipe
    checks it), and the random schemas have optional ones. The grammar enforces either way."""
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": False}}


def test_json_schema_outputs_validate(cluster):
    """40 random schemas (nested objects, arrays, enums, required fields, uuid / ipv4 formats),
    every other one streamed, greedy and sampled: every output parses and validates."""
    async def one(c: AsyncOpenAI, i: int, schema: dict) -> tuple[str, str]:
        kw = dict(model=MODEL, messages=MSGS, max_tokens=400, seed=i, temperature=0.0 if i % 3 == 0 else 1.0,
                  response_format=_schema_format(schema), extra_body=NO_THINK)
        if i % 2:
            text, reason = "", None
            async for ch in await c.chat.completions.create(stream=True, **kw):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    reason = ch.choices[0].finish_reason or reason
            return text, reason
        r = await c.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    async def run():
        async with AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0) as c:
            return await asyncio.gather(*(one(c, i, s) for i, s in enumerate(SCHEMAS)))

    for schema, (text, reason) in zip(SCHEMAS, asyncio.run(run())):
        assert reason == "stop", (text, schema)
        jsonschema.validate(json.loads(text), schema, format_checker=FORMAT)


SCHEMAS = schemas(40, seed=27)


def test_openai_parse_helpers(cluster):
    c = _client(cluster)
    r = c.chat.completions.parse(model=MODEL, messages=MSGS, response_format=Person, max_tokens=400, seed=1,
                                 extra_body=NO_THINK)
    assert isinstance(r.choices[0].message.parsed, Person) and r.choices[0].finish_reason == "stop"
    with c.chat.completions.stream(model=MODEL, messages=MSGS, response_format=Person, max_tokens=400, seed=2,
                                   extra_body=NO_THINK) as s:
        assert isinstance(s.get_final_completion().choices[0].message.parsed, Person)
    r = c.responses.parse(model=MODEL, input="Answer in JSON.", text_format=City, max_output_tokens=200,
                          extra_body={"seed": 3, **NO_THINK})
    assert isinstance(r.output_parsed, City)


def test_json_object_and_regex(cluster, ckpt):
    """json_object: any object. The random model writes object keys without end, so most samples
    stop at max_tokens; every one stays inside the grammar (its ids replayed through a matcher),
    and those that end (seed 5 here) parse to an object."""
    c = _client(cluster)
    body = {"model": MODEL, "messages": MSGS, "response_format": {"type": "json_object"}}
    r = c.chat.completions.create(**body, max_tokens=60, temperature=1.0, seed=0, n=6,
                                  extra_body={"return_token_ids": True, **NO_THINK})
    fmt = DeepSeekFormat(ckpt, MODEL, default_thinking=False)
    grammar = GrammarBackend(ckpt, 129280, (fmt.tokenizer.encode("<｜end▁of▁sentence｜>")[0],))
    tag = structural_tag("chat", fmt.convert("chat", body)[0], body, False, fmt.marker_ids)[0]
    for ch in r.choices:
        assert grammar.matcher(tag, ch.model_extra["token_ids"]) is not None
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(ch.message.content), dict)
    assert [ch.finish_reason for ch in r.choices].count("stop") >= 1
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    for seed, stream in ((1, False), (2, True), (3, True)):
        kw = dict(model=MODEL, messages=MSGS, max_tokens=40, seed=seed, stream=stream,
                  response_format={"type": "regex", "regex": pattern}, extra_body=NO_THINK)
        r = c.chat.completions.create(**kw)
        text = "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if stream \
            else r.choices[0].message.content
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_calls(cluster, choice):
    c = _client(cluster)
    for seed in (1,):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather or time?"}],
                                      tools=[WEATHER, TIME], tool_choice=choice, max_tokens=300, seed=seed,
                                      extra_body=NO_THINK)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        for call in ch.message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
            assert choice == "required" or call.function.name == "get_time"


def test_langchain_with_structured_output(cluster):
    from langchain_openai import ChatOpenAI
    def llm(seed: int):
        return ChatOpenAI(base_url=cluster.base_url + "/v1", api_key="none", model=MODEL, temperature=1.0, seed=seed,
                          max_tokens=400, max_retries=0, extra_body=NO_THINK)
    assert isinstance(llm(1).with_structured_output(Person, method="json_schema").invoke("Describe a person."), Person)
    chunks = list(llm(2).with_structured_output(Person, method="json_schema").stream("Describe a person."))
    assert chunks and isinstance(chunks[-1], Person)
    # json_mode: any object; this random model ends one for this prompt and seed (see json_object above)
    assert isinstance(llm(5).with_structured_output(None, method="json_mode").invoke(MSGS[0]["content"]), dict)


@pytest.mark.parametrize("pd", ["cluster", "mtp_cluster"])
def test_constrained_pd_equals_in_process(pd, reference, ckpt, request):
    """Greedy and seeded, with and without MTP (next_n 3: prefill ships drafts made past a
    constrained token #1, decode verifies them under the grammar): the P/D tokens are the
    in-process next_n 0 engine's, given the grammar the gateway builds."""
    fmt = DeepSeekFormat(ckpt, MODEL, default_thinking=False)
    c = _client(request.getfixturevalue(pd))
    cases = [(_schema_format(SCHEMAS[0]), 0.0, 5), (_schema_format(SCHEMAS[1]), 0.9, 6), (None, 0.8, 8)]
    if pd == "mtp_cluster":
        cases = cases[1:]
    for rf, temperature, seed in cases:
        body = {"model": MODEL, "messages": MSGS, **({"response_format": rf} if rf else {})}
        r = c.chat.completions.create(**body, max_tokens=MAX_PD, temperature=temperature, seed=seed,
                                      extra_body={"return_token_ids": True, **NO_THINK})
        cr, _ = fmt.convert("chat", body)
        params = SamplingParams(max_new_tokens=MAX_PD, temperature=temperature, seed=seed,
                                structured=structural_tag("chat", cr, body, False, fmt.marker_ids)[0])
        prompt = r.model_extra["prompt_token_ids"]
        assert prompt == fmt.encode(cr, 4096, "messages")
        assert r.choices[0].model_extra["token_ids"] == reference.generate([prompt], params)[0].output_ids


def test_a_constraint_that_does_not_compile_is_a_400_and_frees_the_reservation(cluster):
    c = _client(cluster)
    with pytest.raises(Exception) as e:
        c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, extra_body=NO_THINK,
                                  response_format=_schema_format({"type": "integer", "minimum": 5, "maximum": 1}))
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format", e.value.body
    assert "Invalid range" in e.value.body["message"]
    wait_idle(cluster, ("prefill0", "decode0"))
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, extra_body=NO_THINK)
    assert r.choices[0].finish_reason in ("stop", "length")
