"""Output processing through the real gateway equals DeepSeek's recipe for the same token ids.

The gateway parses model output with DeepSeek's own library (``deepseek_recipe``): one
``StreamProcessor`` per sample, fed by ``server.gateway.recipe_stream.RecipeAssembler`` under vLLM's token
rules, shaped per API by ``server.gateway.chat_completions`` / ``server.gateway.responses`` / ``server.gateway.messages``. This package
checks that nothing is lost or changed on the way: for a corpus of model outputs (text tokenised
with the tiny checkpoint's real DeepSeek-V4 tokenizer, EOS appended where the output ends with
finish "stop"; the others end by "length") the expected value is computed here by feeding the same
ids straight into a ``deepseek_recipe.StreamProcessor`` built from the same request's conversion
(one token per ``tokens`` chunk, the final stop token as ``InferenceChunk.text("", 1)``, then
``finish``), and the gateway must give the same message (content, reasoning_content, tool calls
with their parsed JSON arguments; tool-call ids are random), finish_reason and usage
(completion / reasoning tokens):

* non-streamed and streamed (SSE re-assembled), through the ASGI app over a scripted backend that
  emits one token per event, all ids in one event, and two events split at sampled k;
* at every split point k (two events: ids[:k], ids[k:]) through the chat job and its assemblers
  directly, streamed (with return_token_ids: the ids come back whole) and not;
* /v1/responses and /v1/messages: the recipe's whole response object and its whole event sequence
  (ids and timestamps aside), stop_sequences / stop_reason included;
* the gateway's extras beyond the recipe (chat): n=3, return_token_ids, include_stop_str_in_output
  (stop string, stop token), stream_options.include_usage / continuous_usage_stats,
  skip_special_tokens with EOS / BOS mid-output (ignore_eos), logprobs.

Why: the tiny random model never writes ``</think>`` or DSML, so the gateway's output path is only
exercised by scripted ids; the recipe is the reference for what DeepSeek's API returns for them.
With tools declared, raw DSML markup must never reach ``content`` (malformed or truncated blocks
included); a stop string inside reasoning or inside a tool-call block must not cut the output.
"""
