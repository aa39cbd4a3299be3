"""Ahead-of-time bundles: compile every config for a target on a machine without a GPU, run them elsewhere, bring
the statistics back into tuned-config files. Formats: docs/AOT.md."""
