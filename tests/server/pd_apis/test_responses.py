"""Responses (``create`` and streamed, ``create(stream=True)`` and the SDK's helper) through the
``openai`` SDK."""
from __future__ import annotations

import pytest

from .common import Recipe, dump, noclock, output_texts, responses_body


RESPONSES_CREATE_N, RESPONSES_STREAM_N = 8, 6


def greedy_cases(recipe: Recipe, bos_id: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) of every request this module compares with the engine (``greedy``)."""
    return [(recipe.prompt_ids("responses", responses_body(n, t)), n)
            for n in (RESPONSES_CREATE_N, RESPONSES_STREAM_N) for t in (True, False)]


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_responses_create_equals_recipe_of_engine_ids(stack, oai, recipe, greedy, thinking):
    n = RESPONSES_CREATE_N
    body = responses_body(n, thinking)
    raw = oai.responses.with_raw_response.create(**body)
    r = raw.parse()
    stack.ledger.append(r.usage.output_tokens)
    prompt = recipe.prompt_ids("responses", body)
    want = greedy(prompt, n)
    expected = recipe.response("responses", body, want, r.id)
    assert noclock(raw.http_response.json()) == expected
    text, reasoning = output_texts(expected["output"])
    assert r.output_text == text
    assert output_texts(dump(r)["output"]) == (text, reasoning)
    assert bool(reasoning) == thinking and bool(text) != thinking
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(prompt), n)
    assert r.usage.output_tokens_details.reasoning_tokens == (n if thinking else 0)


@pytest.mark.parametrize("how", ["create-stream", "stream-helper"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_responses_stream_events_equal_recipe_of_engine_ids(stack, oai, recipe, greedy, thinking, how):
    n = RESPONSES_STREAM_N
    body = responses_body(n, thinking)
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
    assert [{k: v for k, v in dump(e).items() if k not in ("snapshot", "parsed")} for e in events] == \
        [noclock(e) for e in expected]
    delta = "response.output_text.delta" if not thinking else "response.reasoning_text.delta"
    text = "".join(e.delta for e in events if e.type == delta)
    assert text and text == "".join(output_texts(noclock(expected[-1]["response"]["output"])))
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (len(prompt), n)
