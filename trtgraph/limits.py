"""Per-request limits that size persistent device tables: the request validator
(runtime/serving/sampling_params.py) and the step buffers (runtime/step/buffers.py) both import
them from here, so neither imports the other."""

LOGIT_BIAS_CAPACITY = 300  # entries per request (OpenAI's limit); the per-slot device table holds this many
MAX_STOP_TOKEN_IDS = 16  # stop token ids per request (with min_tokens they are masked in the graph)
MAX_LOGPROBS = 20  # alternatives per token; the graph computes this many for every row that asks
# stop ids masked for min_tokens: the model's EOS ids (up to 8) and the request's stop ids
MAX_STOP_IDS = MAX_STOP_TOKEN_IDS + 8
