"""Usage when the length limit cuts a character; last, the gateway's generation-token counter against the
ledger of every completion token the package's tests received."""
from __future__ import annotations

import pytest

from engine.tokenizer import Tokenizer
from pd_util import wait_idle

from .common import (MODEL, THINK_OFF, THINK_ON, Recipe, chat_kwargs, dump, generation_tokens, messages_kwargs,
                     output_texts)


# conversations all three chat APIs render alike, whose greedy output cut at n tokens ends inside a
# character (its last tokens are the first bytes of one): (system, user, n, thinking)
PARTIAL = {"answer": ("You answer in one word.", "What is the weather in Paris?", 7, False),
           "reasoning": ("You are terse.", "Name an animal.", 13, True)}


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


def greedy_cases(recipe: Recipe, bos_id: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) of every request this module compares with the engine (``greedy``)."""
    return [(recipe.prompt_ids("messages", _partial_bodies(c)["messages"]), PARTIAL[c][2]) for c in PARTIAL]


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
    g0 = generation_tokens(stack)
    reasoning = None                                               # reasoning tokens reported (thinking)
    if api == "chat":
        kw = chat_kwargs(body, return_token_ids=True)
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
        text = output_texts(dump(r)["output"])[1 if thinking else 0]
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        kw = messages_kwargs({k: v for k, v in body.items() if k != "temperature"})
        if stream:
            with ant.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = ant.messages.create(**kw)
        used = m.usage.output_tokens
        text = m.content[0].thinking if thinking else m.content[0].text
        assert m.stop_reason == "max_tokens"
    delta = generation_tokens(stack) - g0
    stack.ledger.append(delta)        # this request's usage is what is under test here: the ledger takes
    assert delta == n                 # the gateway's count, checked against the engine's
    assert text == text_want
    assert used == n, f"{api} usage counts {used} of the {n} tokens generated"
    if thinking and api != "messages":
        assert reasoning == n, f"{api} usage counts {reasoning} of the {n} reasoning tokens generated"


# ---- metrics (last: it checks the ledger of every test above) ----------------------------------------
def test_generation_tokens_total_moved_by_the_tokens_received(stack, oai, ant):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                    temperature=0)
    stack.ledger.append(r.usage.completion_tokens)
    m = ant.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                            extra_body={"temperature": 0})
    stack.ledger.append(m.usage.output_tokens)
    wait_idle(stack, ["prefill0", "decode0"])
    assert generation_tokens(stack) - stack.gen0 == sum(stack.ledger)
