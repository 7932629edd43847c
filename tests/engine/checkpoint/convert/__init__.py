"""dsv4-convert-config / dsv4-convert-model (issue 7): every quant type converts, loads and
generates; logit error vs the original FP8-MXFP4 model within per-type bounds; bad input leaves
nothing behind; an interrupted run resumes; converting holds about two shards in memory."""
