"""Calibration: ``train`` (the training loop, resumable checkpoints), ``recovery`` (stage 2,
LoRA) and ``distributed`` (FSDP2, DCP checkpoints). Reads the method and io/."""
