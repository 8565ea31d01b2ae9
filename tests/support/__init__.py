"""Test tooling, not shipped in the wheel: the dense oracle, tiny models, multi-process helpers and the peak-memory meter."""
