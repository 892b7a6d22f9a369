"""The KV layouts the engine can run: the paged one, and the research baselines beside it."""
