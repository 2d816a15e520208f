"""The method: ``WideConfig`` (``config``), the token routers (``routers``), a model's groups and
their costs (``geometry``), the state the hooks share (``state``), ``wrap(model)`` and its routing
hooks (``modeling``), sparsity accounting (``sparsity``), offset calibration (``offsets``),
per-element activation sparsity (``fine``), training aids for head routers that skip the smallest-margin
groups beside frozen thresholds (``head_choice``) and the baselines (``baselines``). Reads base/ and the
kernels' PyTorch references."""
