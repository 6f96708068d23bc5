"""What one request may ask the router for, by default: defined once for the router's own defaults and
the operator's InferenceService spec (router.limits), which render into the router's config.

A non-streamed answer is held whole in the router until it is sent, so its size is bounded by what
the request asks for: n choices of max_tokens tokens each, and with logprobs 1 + top_logprobs
entries per token (at top_logprobs 20, about 15 KB of Python objects per token while it is built).
"""

from __future__ import annotations

MAX_OUTPUT_TOKENS = 4096  # max_tokens one choice may ask for (also the model's context - 1 at most)
MAX_REQUEST_OUTPUT_TOKENS = 65536  # n x max_tokens: every choice's tokens together (16 choices of 4096)
# n x max_tokens x (1 + top_logprobs): log probabilities in one answer (one choice of 4096 tokens with
# 20 alternatives each fits: about 65 MB and 0.3 s while built; 16 such choices, over 1 GB, do not)
MAX_REQUEST_LOGPROBS = 131072
