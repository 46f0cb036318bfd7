"""The fetch stage's parts: sources, downloads, failures, archives, checks, the builtin corpus."""
