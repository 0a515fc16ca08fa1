"""Normalizations and activations: RMSNorm / LayerNorm / GeLU fusion and decomposition, fp16 safety."""
