"""Outliers in the residual stream: rewrites that change no fp32 output but shrink the ranges a
per-tensor quantizer has to cover (norm-weight folding, residual-stream rotation,
SmoothQuant-style scale migration), or keep the stream inside fp16's range (power-of-two scaling)."""
