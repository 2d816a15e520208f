"""What the ``wide`` commands run beyond library calls: ``runs`` (the options and plumbing every
run shares: loading, packing, held-out text, records), ``compare``, ``demo``, ``sampling_data``
(``wide sample-data``) and ``estimate`` (``wide calibrate --dry-run``). Reads every layer below;
``wide.cli`` and ``wide.harness`` sit on top of it."""
