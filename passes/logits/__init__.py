"""The logits a language model outputs: ``logits-offset`` (logits relative to their row's maximum,
at the resolution fp16 has near zero instead of near the largest logit)."""
