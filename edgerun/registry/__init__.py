"""Model registry: manifests (models/*.yaml), the cache, and pulling models from the package index.

The names below are the registry's public face; each lives in one module of this package."""

from .cache import cache_dir, cached_path, is_cached, resolve_model
from .fetch import Progress, pull, verify_cached
from .manifest import (Manifest, Piece, Variant, default_draft_for, get_manifest, list_models, load_manifests, models_dir,
                       parse_manifest, split_name)

__all__ = ["Manifest", "Piece", "Progress", "cache_dir", "cached_path", "default_draft_for", "get_manifest",
           "is_cached", "list_models", "load_manifests", "models_dir", "parse_manifest", "pull", "resolve_model",
           "verify_cached", "split_name", "Variant"]
