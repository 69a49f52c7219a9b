"""Models and prompts shared by the speculative-decoding benchmarks (bench/spec.py, bench/tuner.py)."""

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
SMALL = "smollm2-135m-instruct"

CODE_PROMPTS = [
    'def quicksort(items):\n    """Return a new list with the items sorted in ascending order (quicksort)."""\n',
    "import json\nfrom pathlib import Path\n\n\nclass Config:\n"
    '    """Load a JSON configuration file and give attribute access to its keys."""\n\n'
    "    def __init__(self, path):\n",
]


def summarise_prompt() -> str:
    """A summarise-this-text request over CPython's own reference prose (copy-heavy: lookup drafts well)."""
    from pydoc_data.topics import topics

    text = topics["while"] + "\n" + topics["if"] + "\n" + topics["break"]
    return f"Summarise the following text in a few sentences.\n\n{text}"
