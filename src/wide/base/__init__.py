"""The bottom layer, read by every other: the architecture registry (``arch``), options declared
as dataclass fields (``cliargs``), crash-safe file writes (``fileio``) and the one timer
(``timing``). Imports nothing of wide."""
