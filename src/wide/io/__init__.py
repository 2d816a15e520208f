"""Router checkpoints on disk: ``serialization`` (safetensors + JSON, crash-safe directories)
and ``pretrained`` (the sets shipped in ``wide/shipped``, loadable by name). Reads the method
and data/ (the default model)."""
