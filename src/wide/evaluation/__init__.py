"""Measurement of a wrapped model: ``evaluate`` (perplexity, bits per byte, zero-shot) and
``analysis`` (per-layer sparsity, group firing, distinct masks). Reads the method and data/."""
