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
- ``tool_call`` (tools with ``tool_choice`` auto): not constrained, as in vLLM / SGLang.
- Thinking mode: the reasoning runs free up to ``</think>``; the constraint starts after it.

The chat format's markers (``｜DSML｜``, ``</think>``) are matched as their token ids: xgrammar
matches text, and a byte-level spelling of a marker is text the recipe's parser (which reads
marker ids) does not see as a marker. Raw string parameters exclude "｜" for the same reason.
JSON allows at most ``MAX_JSON_WHITESPACE`` consecutive whitespace characters (pretty-printed
JSON 7 levels deep at indent 2): unbounded whitespace is the loop small or confused models fall
into, and the grammar then never ends.
"""
from __future__ import annotations

import json

import deepseek_recipe as dr

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
    if s.get("type") == "string" and not set(s) & {"$ref", "anyOf", "oneOf", "allOf", "const"}:
        if isinstance(s.get("enum"), list):
            value = {"type": "or", "elements": _lit(*[str(v) for v in s["enum"]])}
        elif isinstance(s.get("pattern"), str):
            value = {"type": "regex", "pattern": s["pattern"]}
        else:
            lo, hi = s.get("minLength"), s.get("maxLength")
            lo, hi = (lo if isinstance(lo, int) else 0), (hi if isinstance(hi, int) else "")
            value = {"type": "regex", "pattern": f"[^｜]{{{lo},{hi}}}"}
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


def structural_tag(cr: dr.ConversationRequest, body: dict, reasoning: bool, markers: dict[str, int]) -> str | None:
    """The structural tag (compact JSON text) enforcing ``cr``'s output constraint, or None.

    Args:
        cr: the converted request (``cr.inference_options.output_constraint``: its kind, the
            tools a required / named choice allows).
        body: the request body (the schema and tool parameters as sent, ``parallel_tool_calls``;
            Messages: ``tool_choice.disable_parallel_tool_use``).
        reasoning: the output begins inside the reasoning (``DeepSeekFormat.starts_in_reasoning``).
        markers: token ids of ``<think>``, ``</think>`` and ``｜DSML｜`` (``DeepSeekFormat.marker_ids``).
    """
    oc = cr.inference_options.output_constraint
    if oc is None or oc.kind == "tool_call":
        return None
    if oc.kind == "json":
        # json_object: an object (OpenAI's JSON mode; the recipe's output processing expects one)
        schema = _request_schema(body) if oc.schema else {"type": "object"}
        fmt = _json(schema if schema is not None else json.loads(oc.schema))
    elif oc.kind == "regex":
        fmt = {"type": "regex", "pattern": oc.schema}
    elif oc.kind == "tool_call_required":
        choice = body.get("tool_choice")
        parallel = body.get("parallel_tool_calls") is not False and not (
            isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
        fmt = _tool_calls(json.loads(oc.schema), _request_tools(body), parallel,
                          cr.parsing_options.starts_in_tool_calls, markers["｜DSML｜"])
    else:
        raise ValueError(f"unknown output constraint kind {oc.kind!r}")
    return _tag(fmt, reasoning, markers)


def _tag(fmt: dict, reasoning: bool, markers: dict[str, int]) -> str:
    if reasoning:
        think = {"type": "tag", "begin": "", "end": {"type": "token", "token": markers["</think>"]},
                 "content": {"type": "any_tokens", "exclude_tokens": [markers["<think>"], markers["</think>"]]}}
        fmt = _seq([think, fmt])
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False, separators=(",", ":"))


def messages_format(body: dict, reasoning: bool, markers: dict[str, int]) -> str | None:
    """Anthropic's structured outputs on /v1/messages (``output_config.format``, or the beta's
    top-level ``output_format``: ``{"type": "json_schema", "schema": {...}}``), which the recipe
    does not convert, as a structural tag; None when the body has neither.

    Raises:
        ApiError: 400 naming the field when it is not a json_schema format with an object schema.
    """
    cfg = body.get("output_config")
    name, f = "output_format", body.get("output_format")
    if isinstance(cfg, dict) and cfg.get("format") is not None:
        name, f = "output_config.format", cfg["format"]
    if f is None:
        return None
    if not isinstance(f, dict) or f.get("type") != "json_schema" or not isinstance(f.get("schema"), dict):
        raise ApiError(f'{name}: expected {{"type": "json_schema", "schema": {{...}}}}', 400, name)
    return _tag(_json(f["schema"]), reasoning, markers)
