"""Model file formats: GGUF read/write and header scan, Hugging Face checkpoints, architecture tables.

Empty on purpose: the header scan (ggufscan.py) is imported on every model load and must not pull in the
weight readers; `open_source` is in source.py."""
