"""Adapters between inference frameworks and the kvstore client.

Each adapter lives in its own module and imports its framework there, so importing
`kvstore` never requires a framework to be installed:

- `kvstore.integrations.hf` — Hugging Face `transformers` causal LMs (DynamicCache).
"""
