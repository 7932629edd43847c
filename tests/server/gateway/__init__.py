"""OpenAI gateway: a real uvicorn server, the real ``openai`` client, LocalBackend over the tiny engine.

Expected values come from the same engine run directly (``engine.generate``) before the server
starts: greedy text, seeded samples, logprobs; chat prompt ids are DeepSeek's recipe's encoding
(``server.gateway.dsformat``). The app runs with thinking off by default so the random model's text lands in
``content`` (stop strings apply to content only); thinking mode is checked on its own. DSML tool-call
and reasoning parsing are covered by the package tests/server/format_outputs/ (the random model never writes one).
"""
