"""Small mechanisms every room shares: atomic writes, packaged data, strict YAML into dataclasses."""
