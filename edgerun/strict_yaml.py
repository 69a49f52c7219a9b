"""Our YAML is strict: one loader for manifests and device profiles that refuses duplicate keys
(PyYAML silently keeps the last one). Unknown keys are refused by each file's schema."""

from __future__ import annotations

import yaml


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that raises on a duplicate mapping key."""


def _construct_mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (each key may appear once)", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load(text: str):
    """Parse YAML text strictly (raises yaml.YAMLError on syntax errors and duplicate keys)."""
    return yaml.load(text, Loader=StrictLoader)
