"""The reference: DeepSeek's recipe fed the same ids directly (``recipe``), and what must agree when the
gateway's output is compared with it (summaries, SSE parsing, streamed chunks re-assembled, ids and
clocks normalised)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import deepseek_recipe as dr

from serve_util import reasoning_from_ids, set_reasoning_usage

from .corpus import MODEL

FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length}
OPTIONS = dr.ConversionOptions().with_model_versions_by_name({MODEL: dr.ModelVersion.DeepseekV4Pro})


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


# ---- comparing /v1/responses and /v1/messages outputs -----------------------------------------------------
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
