"""``Env``: the gateway app (over a ``ScriptedBackend`` that records what it is sent) and the recipe's
own encoding, side by side; built once for the package by ``conftest.env``."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import deepseek_recipe as dr
import httpx
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import Tokenizer

from .corpus import CHAT, MSGS, NAME, RESP

RECIPE_REQUEST = {CHAT: dr.ChatCompletionRequest, RESP: dr.ResponsesRequest, MSGS: dr.MessagesRequest}


@dataclass
class Env:
    tok: Tokenizer                         # the gateway's tokenizer (decode, completions)
    hf: HFTokenizer                        # the same tokenizer.json, through HF tokenizers
    encoding: dr.DeepseekV4Encoding
    apps: dict                             # default_thinking -> app
    backends: dict                         # default_thinking -> ScriptedBackend
    special_ids: frozenset                 # every added token of the vocabulary

    def sid(self, spelling: str) -> int:
        """The special id of ``spelling`` (the full-vocabulary encode of it alone)."""
        ids = self.hf.encode(spelling, add_special_tokens=False).ids
        assert len(ids) == 1, (spelling, ids)
        return ids[0]

    def recipe_ids(self, path: str, body: dict, default_thinking: bool = True) -> list[int]:
        """The recipe's own prompt ids for ``body`` (the served name -> DeepSeek-V4's encoding)."""
        opts = (dr.ConversionOptions(default_thinking_mode=default_thinking)
                .with_model_versions_by_name({NAME: dr.ModelVersion.DeepseekV4Pro}))
        cr = RECIPE_REQUEST[path]({**body, "model": NAME}).convert(opts)
        return self.encoding.encode(cr.conversation)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def send(self, path: str, body: dict, default_thinking: bool = True, model: str | None = NAME
             ) -> tuple[httpx.Response, list]:
        """POST ``body`` (with ``model`` unless None) to the gateway; (response, the GenRequests it sent)."""
        app, backend = self.apps[default_thinking], self.backends[default_thinking]
        before = len(backend.requests)
        payload = body if model is None else {"model": model, **body}

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                         timeout=30) as c:
                return await c.post(path, json=payload)

        r = asyncio.run(go())
        return r, backend.requests[before:]
