"""A request's output constraint as the grammar the workers enforce.

deepseek-recipe turns ``response_format`` (Chat), ``text.format`` (Responses) and a required /
named ``tool_choice`` into an ``OutputConstraint`` (kind + schema); Messages' structured output
(``output_config.format``) the recipe leaves alone, so it is read here. This module writes the
constraint as an xgrammar structural tag (its documented JSON form, so the gateway needs neither
xgrammar nor torch), which travels in ``SamplingParams.structured`` to prefill and decode; each
worker compiles it once per distinct text (``engine.core.grammar``).

- ``json``: the schema as the client sent it (``json_object``: any JSON object).
- ``regex``: the regular expression, matched in full.
- ``tool_call_required`` (``tool_choice`` required or named): DeepSeek-V4's DSML tool-call block
  in the canonical layout the chat template renders (reference/dsv4-architecture.md, chat
  encoding), each invoke one of the allowed tools, its parameters in the schema's order, string
  ones raw (``string="true"``), the others JSON valid for their schema. The recipe's prompt
  already opens the block.
- ``tool_call`` (tools with ``tool_choice`` auto): not constrained, as in vLLM / SGLang; beside a
  response format, either a tool-call block or the formatted answer.
- Thinking mode: the reasoning runs free up to ``</think>``; the constraint starts after it.

The chat format's markers (``｜DSML｜``, ``</think>``) are matched as their token ids: xgrammar
matches text, and a byte-level spelling of a marker is text the recipe's parser (which reads
marker ids) does not see as a marker. A worker's vocabulary puts a \x01 before each marker's
text, so no JSON value (nor a raw string parameter, which excludes it) can hold one.
JSON allows at most ``MAX_JSON_WHITESPACE`` consecutive whitespace characters (pretty-printed
JSON 7 levels deep at indent 2): unbounded whitespace is the loop small or confused models fall
into, and the grammar then never ends.
"""
from __future__ import annotations

import json

import deepseek_recipe as dr

from engine.core.sampling_params import MAX_STRUCTURED_CHARS
from server.gateway.protocol import ApiError

MAX_JSON_WHITESPACE = 16


def _json(schema) -> dict:
    return {"type": "json_schema", "json_schema": schema, "style": "json", "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _lit(*parts) -> list[dict]:
    """Const strings and marker token ids (ints) in order."""
    return [{"type": "token", "token": p} if isinstance(p, int) else {"type": "const_string", "value": p}
            for p in parts]


def _seq(elements: list[dict]) -> dict:
    return {"type": "sequence", "elements": elements}


def _request_schema(body: dict):
    """The JSON schema as the request sent it (Chat: ``response_format.json_schema.schema``;
    Responses: ``text.format.schema``), or None. The recipe's copy of it is normalised for the
    prompt and loses keywords (``maxLength``, ``$defs`` while ``$ref`` stays), so the grammar
    enforces the client's schema, which the recipe has validated."""
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict):
        return rf["json_schema"].get("schema")
    text = body.get("text")
    tf = text.get("format") if isinstance(text, dict) else None
    if isinstance(tf, dict) and tf.get("type") == "json_schema":
        return tf.get("schema")
    return None


def _request_tools(body: dict) -> dict[str, dict]:
    """Tool name -> parameters schema as the request sent them (Chat ``function.parameters``,
    Responses ``parameters``, Messages ``input_schema``)."""
    out = {}
    for t in body.get("tools") or ():
        if isinstance(t, dict):
            fn = t.get("function") if isinstance(t.get("function"), dict) else t
            params = fn.get("parameters", t.get("input_schema"))
            if isinstance(fn.get("name"), str) and isinstance(params, dict):
                out[fn["name"]] = params
    return out


def _param(name: str, schema, defs: dict, dsml: int) -> dict:
    """One ``<｜DSML｜parameter ...>value</｜DSML｜parameter>\\n`` line."""
    s = schema if isinstance(schema, dict) else {}
    enum = s.get("enum")
    if s.get("type") == "string" and not set(s) & {"$ref", "anyOf", "oneOf", "allOf", "const"} and (
            enum is None or (isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum))):
        if enum:
            value = {"type": "or", "elements": _lit(*enum)}
        elif isinstance(s.get("pattern"), str):
            value = {"type": "regex", "pattern": s["pattern"]}
        else:
            lo, hi = s.get("minLength"), s.get("maxLength")
            lo, hi = (lo if isinstance(lo, int) else 0), (hi if isinstance(hi, int) else "")
            value = {"type": "regex", "pattern": f"[^｜\\x01]{{{lo},{hi}}}"}
        flag = "true"
    else:
        value, flag = _json({**defs, **s} if defs else schema), "false"
    return _seq([*_lit("<", dsml, f'parameter name="{name}" string="{flag}">'), value,
                 *_lit("</", dsml, "parameter>\n")])


def _invoke(name: str, schema: dict, dsml: int) -> dict:
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or ())
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    params = [_param(p, s, defs, dsml) for p, s in props.items()]
    params = [p if k in required else {"type": "optional", "content": p} for k, p in zip(props, params)]
    return _seq([*_lit("<", dsml, f'invoke name="{name}">\n'), *params, *_lit("</", dsml, "invoke>\n")])


def _tool_calls(tools: list, sent: dict[str, dict], parallel: bool, opened: bool, dsml: int) -> dict:
    names = [(t.get("function") or {}).get("name", "") for t in tools]
    calls = [_invoke(n, sent.get(n) or (t.get("function") or {}).get("parameters") or {}, dsml)
             for n, t in zip(names, tools)]
    call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    body = {"type": "plus", "content": call} if parallel else call
    head = [] if opened else _lit("\n\n<", dsml, "tool_calls>\n")
    return _seq([*head, body, *_lit("</", dsml, "tool_calls>")])


def _response_format(api: str, body: dict, oc) -> tuple[dict | None, str]:
    """The output format the request asks for, as a structural-tag format (None: text), and the
    request field it comes from. Chat / Responses: the recipe's constraint when it is json /
    regex (the recipe validated it), else the body's own (tools beside it); Messages: ``output_config.format``
    (or the beta's ``output_format``), which the recipe does not convert.

    Raises:
        ApiError: 400 naming the Messages field when it is not ``{"type": "json_schema", "schema": {...}}``.
    """
    if api == "messages":
        cfg = body.get("output_config")
        name, f = "output_format", body.get("output_format")
        if isinstance(cfg, dict) and cfg.get("format") is not None:
            name, f = "output_config.format", cfg["format"]
        if f is None:
            return None, name
        if not isinstance(f, dict) or f.get("type") != "json_schema" or not isinstance(f.get("schema"), dict):
            raise ApiError(f'{name}: expected {{"type": "json_schema", "schema": {{...}}}}', 400, name)
        return _json(f["schema"]), name
    name = "response_format" if api == "chat" else "text.format"
    if oc is not None and oc.kind == "regex":
        return {"type": "regex", "pattern": oc.schema}, name
    rf = body.get("response_format") if api == "chat" else (body.get("text") or {}).get("format")
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "json_object":           # any object (OpenAI's JSON mode; the recipe's output processing expects one)
        return _json({"type": "object"}), name
    if kind == "json_schema":
        schema = _request_schema(body)
        return (_json(schema) if schema is not None else None), name
    if kind == "regex" and isinstance(rf.get("regex"), str):
        return {"type": "regex", "pattern": rf["regex"]}, name
    if oc is not None and oc.kind == "json":          # a form this module does not know: the recipe's copy
        return _json(json.loads(oc.schema) if oc.schema else {"type": "object"}), name
    return None, name


def _continues(api: str, body: dict) -> bool:
    """The prompt ends inside an assistant message the output continues (Chat ``prefix: true``;
    Messages: a final assistant message)."""
    msgs = body.get("messages")
    last = msgs[-1] if isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) else {}
    return last.get("role") == "assistant" and (api == "messages" or last.get("prefix") is True)


def structural_tag(api: str, cr: dr.ConversationRequest, body: dict, reasoning: bool,
                   markers: dict[str, int]) -> tuple[str | None, str]:
    """The structural tag (compact JSON text) enforcing the request's output constraint (None:
    none) and the request field a compile error names.

    A required / named tool choice wins over a response format (the prompt already opens the
    tool-call block); beside tools with ``tool_choice`` auto a response format allows either a
    tool-call block or the formatted answer.

    Args:
        api: ``chat``, ``responses`` or ``messages``.
        cr: the converted request (``cr.inference_options.output_constraint``: its kind, the
            tools a required / named choice allows).
        body: the request body (the schema and tool parameters as sent, ``parallel_tool_calls``;
            Messages: ``tool_choice.disable_parallel_tool_use``, ``output_config.format``).
        reasoning: the output begins inside the reasoning (``DeepSeekFormat.starts_in_reasoning``).
        markers: token ids of ``<think>``, ``</think>`` and ``｜DSML｜`` (``DeepSeekFormat.marker_ids``).
    Raises:
        ApiError: 400 naming the field: a bad Messages format, a format on a continued assistant
            message, a constraint longer than ``MAX_STRUCTURED_CHARS``.
    """
    oc = cr.inference_options.output_constraint
    fmt, field = _response_format(api, body, oc)
    if oc is not None and oc.kind in ("tool_call", "tool_call_required"):
        choice = body.get("tool_choice")
        parallel = body.get("parallel_tool_calls") is not False and not (
            isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
        forced = oc.kind == "tool_call_required"
        calls = _tool_calls(json.loads(oc.schema), _request_tools(body), parallel,
                            forced and cr.parsing_options.starts_in_tool_calls, markers["｜DSML｜"])
        if forced:
            fmt, field = calls, "tools"
        elif fmt is not None:
            fmt = {"type": "or", "elements": [fmt, calls]}
    if fmt is None:
        return None, field
    if field != "tools" and _continues(api, body):
        raise ApiError(f"{field}: cannot constrain the continuation of a prefilled assistant message", 400, field)
    tag = _tag(fmt, reasoning, markers)
    if len(tag) > MAX_STRUCTURED_CHARS:
        raise ApiError(f"{field}: the output constraint is {len(tag)} characters; at most {MAX_STRUCTURED_CHARS}",
                       400, field)
    return tag, field


def _tag(fmt: dict, reasoning: bool, markers: dict[str, int]) -> str:
    if reasoning:
        think = {"type": "tag", "begin": "", "end": {"type": "token", "token": markers["</think>"]},
                 "content": {"type": "any_tokens", "exclude_tokens": [markers["<think>"], markers["</think>"]]}}
        fmt = _seq([think, fmt])
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False, separators=(",", ":"))
