"""Deployable LLMs: a HF-style KV-cache export turned into a static prefill + decode pair."""
