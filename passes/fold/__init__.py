"""Constant folding, no-op removal and dead-code clean-up."""
