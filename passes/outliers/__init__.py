"""Outlier removal before quantization: rewrites that change no fp32 output but shrink the
activation ranges a per-tensor quantizer has to cover (norm-weight folding, residual-stream
rotation, SmoothQuant-style scale migration)."""
