"""The gateway and the recipe, built once for every test of the prompt corpus (``env``)."""
from __future__ import annotations

import deepseek_recipe as dr
import pytest
from tokenizers import Tokenizer as HFTokenizer

from engine.checkpoint.make_tiny import copy_tokenizer
from engine.tokenizer import Tokenizer
from server.gateway.app import create_app
from serve_util import ScriptedBackend

from .corpus import NAME
from .env import Env


@pytest.fixture(scope="package")
def env(tmp_path_factory) -> Env:
    d = tmp_path_factory.mktemp("dsv4-tokenizer")
    copy_tokenizer(d)
    tok = Tokenizer(d)
    reply = tok.encode("Sure.")             # two plain tokens: reasoning in thinking mode, content otherwise
    backends = {t: ScriptedBackend((reply, "stop")) for t in (True, False)}
    apps = {t: create_app(backends[t], tok, NAME, default_thinking=t) for t in (True, False)}
    hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
    encoding = dr.DeepseekV4Encoding().with_tokenizer(dr.Tokenizer.from_file(str(d / "tokenizer.json")))
    return Env(tok, hf, encoding, apps, backends, frozenset(hf.get_added_tokens_decoder()))
