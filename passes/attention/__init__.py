"""Attention: masks, grouped-query K/V, head layout, rotary embeddings."""
