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

One stack serves the whole package (``conftest.py``: starting processes is the expensive part); the
in-process engine computes the cases of each module in one batched run. Every completion token a
test receives goes into a ledger; the last test (test_usage.py, the last module) checks the gateway's
``dsv4:generation_tokens_total`` moved by exactly the ledger's sum.
"""
