"""Lowering to what the HTP runs: dtypes (int64 -> int32) and ops it lacks."""
