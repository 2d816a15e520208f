"""The method: ``WideConfig`` (``config``), the token routers (``routers``), ``wrap(model)`` and
its routing hooks, sparsity accounting and offset calibration, per-element activation sparsity
(``fine``) and the baselines (``baselines``). Reads base/ and the kernels' PyTorch references."""
