"""Speculative decoding inside the continuous batch.

A proposer (`ngram.py`, `suffix.py`, `draft_model.py`, behind one interface in
`proposers.py`) drafts up to `num_speculative_tokens` tokens for each decoding request; the
scheduler grants the request 1 + k query
tokens (its last token and the drafts) in the same ragged step as prefill chunks and plain
decodes, a short query run like a prefill chunk's, whose logits are all kept; `verify.py`
accepts the longest prefix the target model agrees with and appends one token more (the
correction or the bonus); the KV manager truncates the rejected tail; `adaptive.py` trims a step's drafts to those
expected to pay. The scheduler and the
KV manager only see a request's `spec_token_ids`, never which proposer made them.
"""

from backend.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
