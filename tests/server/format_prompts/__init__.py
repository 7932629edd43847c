"""The prompt the gateway sends to the workers is DeepSeek's own, for every API and shape of request.

Each conversation goes through the real gateway app (``create_app`` over a ``ScriptedBackend`` that
records the ``GenRequest`` it gets), in process over ASGI. The prompt ids the backend received must
EQUAL ``deepseek_recipe``'s encoding of the same request, computed here independently:
``ChatCompletionRequest`` / ``ResponsesRequest`` / ``MessagesRequest(body).convert(options)`` with
the served name mapped to ``ModelVersion.DeepseekV4Pro``, then ``DeepseekV4Encoding().encode``.
Where a body uses one of the gateway's own normalisations (``developer`` role,
``max_completion_tokens``, vLLM's ``chat_template_kwargs``, vLLM's sampling extras) the expected
side is written by hand in DeepSeek's terms (``system``, ``thinking: {"type": ...}``,
``reasoning_effort``, the extras left out), so the normalisation itself is what is checked. Each
case also pins a value of the decoded prompt (its tail, substrings in order, text that must be
absent) so that an equal-but-wrong rendering on both sides would still fail.

Why: a prompt that differs from the one the model was trained on degrades it silently (no error,
worse answers); and a special-token spelling in user-controlled text that became a special id
would let a client forge turns (a fake ``<｜Assistant｜>``, an early ``</think>``, a BOS). So:

* the chat corpus covers thinking modes (the gateway's default, ``thinking``, vLLM's
  ``chat_template_kwargs`` and their precedence), every ``reasoning_effort`` and its precedence
  over / under ``thinking``, multi-turn history with and without ``reasoning_content``, tools with
  nested schemas, tool results in and out of call order, parallel calls, ``tool_choice`` (a
  required / named choice prefills the tool-call block without thinking and is a 400 with it),
  content parts, system / developer / latest_reminder messages, an assistant-final conversation and
  a ``prefix`` continuation, and hard text (CJK, emoji, RTL, very long lines, empty strings);
  plus /v1/responses and /v1/messages corpora checked against the recipe's converters;
* special-token injection: every spelling the recipe knows (each ``SpecialToken``'s
  ``default_str()``, BOS / EOS / think / User / Assistant / DSML) and, once, every added token of
  the vocabulary, placed in every text field a client controls: the prompt holds exactly the
  special ids the structure needs (one exception, the recipe's: grounding tokens such as
  ``<｜box｜>`` in ASSISTANT text are fed back as the specials the model wrote, see ``GROUNDING``).
  /v1/completions, whose prompt is raw model input (vLLM's behaviour), DOES map the same
  spellings to special ids: the difference is deliberate;
* the served name: only ``deepseek_v4`` is accepted (404 in the API's error shape otherwise), and a
  chat request without a ``model`` is served.

The tokenizer is the real DeepSeek-V4 one (``engine.checkpoint.make_tiny.copy_tokenizer``, the file every tiny
checkpoint ships); no model weights are needed.
"""
