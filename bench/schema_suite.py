"""Are the grammar limits generous enough? Every schema of the JSON Schema Test Suite (the copy inside
the jsonschema source package) and of jsonschema-specifications' metaschemas, through edgerun's limits
alone and through the whole compile (limits, sandbox, llguidance) on a real model.

Reported per source: schemas, refused by edgerun's limits (the number that must stay 0: every refusal
is listed), refused by llguidance itself (features it does not support, e.g. `not`), compiled; and the
deepest nesting and largest schema that passed.

    pip download --no-deps --no-binary :all: jsonschema==4.26.0 -d /tmp/jss
    nice python bench/schema_suite.py --sdist /tmp/jss/jsonschema-4.26.0.tar.gz [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import tarfile
from collections import Counter
from pathlib import Path

from edgerun.constrain.limits import check_schema
from edgerun.errors import GrammarError, InvalidArgument
from edgerun.runtime import load


def suite_schemas(sdist: Path):
    with tarfile.open(sdist) as tf:
        for m in tf.getmembers():
            parts = m.name.split("/")
            if len(parts) >= 4 and parts[1] == "json" and parts[2] == "tests" and m.name.endswith(".json"):
                draft = parts[3]
                for group in json.load(tf.extractfile(m)):
                    yield f"{draft}/{parts[-1]}: {group.get('description', '')[:60]}", group["schema"]


def metaschemas():
    import jsonschema_specifications as js
    for uri, res in js.REGISTRY.items():
        yield uri, res.contents


def depth(x, d=0) -> int:
    stack, best = [(x, 1)], 0
    while stack:
        v, k = stack.pop()
        best = max(best, k)
        if isinstance(v, dict):
            stack.extend((c, k + 1) for c in v.values())
        elif isinstance(v, list):
            stack.extend((c, k + 1) for c in v)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", required=True, type=Path)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default="bench/results/schema_suite.json")
    a = ap.parse_args()
    rt = load(a.model, draft=None, profile="generic-x86_64-cpu", n_threads=2, pull=False)
    result = {}
    for source, items in (("json-schema-test-suite", suite_schemas(a.sdist)), ("metaschemas", metaschemas())):
        counts: Counter = Counter()
        ours, deepest, largest = [], 0, 0
        for name, schema in items:
            counts["schemas"] += 1
            try:
                check_schema(schema)
            except InvalidArgument as e:
                counts["refused by edgerun's limits"] += 1
                ours.append(f"{name}: {e}")
                continue
            deepest = max(deepest, depth(schema))
            largest = max(largest, len(json.dumps(schema)))
            try:
                rt.constraint(json_schema=schema)
                counts["compiled"] += 1
            except GrammarError as e:
                msg = str(e)
                key = "refused by the sandbox's budgets" if "takes more than" in msg or "crashes" in msg \
                    else "refused by llguidance (unsupported or invalid)"
                counts[key] += 1
                if key.startswith("refused by the sandbox"):
                    ours.append(f"{name}: {msg}")
            except InvalidArgument:
                counts["refused by llguidance (unsupported or invalid)"] += 1
        result[source] = {**counts, "deepest_json_nesting_passed": deepest, "largest_chars_passed": largest,
                          "refused_by_edgerun": ours}
        print(f"{source}: " + ", ".join(f"{k} {v}" for k, v in counts.items())
              + f"; deepest passed {deepest} levels, largest {largest} chars")
        for line in ours:
            print("  refused by edgerun:", line)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
