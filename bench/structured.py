"""Structured output: what a grammar costs in the decode loop, and what masked drafts buy, in one interleaved run.

Rows (greedy, the same prompt per model, `--rounds` interleaved rounds, medians):

  plain                 unconstrained decoding
  schema                the same under a JSON schema that cannot finish within --tokens (an array of at
                        least 60 records): constrained / plain is the grammar's whole cost; the mask's own
                        time per token (llguidance + unpacking + applying it to the logits) is timed apart
  spec / spec+schema    the Qwen pair (0.5B drafting for 1.5B) and prompt lookup, gamma fixed: drafts
                        masked per position (edgerun) vs drafted unconstrained and cut at the first
                        forbidden token (what llama.cpp and vLLM do; exact only for greedy, which this is)

    nice python bench/structured.py [--rounds 3] [--tokens 96] [--threads 2] [--models smollm2,qwen]
        [--out bench/results/structured.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import arg_parser, llama_server  # noqa: E402
from workloads import DRAFT, SMALL, TARGET  # noqa: E402

from edgerun.constrain import grammar as grammar_mod  # noqa: E402
from edgerun.constrain.base import apply_mask  # noqa: E402
from edgerun.generate import GenStats  # noqa: E402

RECORDS = {"type": "array", "minItems": 60, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                                     "city": {"type": "string", "maxLength": 16}, "active": {"type": "boolean"}},
    "required": ["id", "name", "city", "active"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "Write a JSON array of customer records with the fields id, name, city and "
                                   "active. Give at least 60 records."}]
SEED_RECORDS = json.dumps([{"id": i, "name": n, "city": c, "active": i % 2 == 0} for i, (n, c) in enumerate(
    [("Ada", "London"), ("Linus", "Helsinki"), ("Grace", "New York"), ("Alan", "Wilmslow"), ("Edsger", "Austin"),
     ("Barbara", "Boston"), ("Ken", "Murray Hill"), ("Margaret", "Boston")])])
COPY_ASK = [{"role": "user", "content": "Here are customer records:\n" + SEED_RECORDS +
             "\nRepeat these records exactly as a JSON array, then continue the list with more records in the "
             "same style until there are at least 60."}]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "languages": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                                         "maxItems": 4},
                                           "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo", "Lima"]}},
          "required": ["name", "age", "languages", "city"], "additionalProperties": False}


def validity(rt, n: int) -> dict:
    """n sampled answers (t 0.8, seeds 0..n-1) under PERSON: how many end, parse and validate (jsonschema)."""
    import jsonschema

    ok = ended = 0
    for seed in range(n):
        c = rt.chat([{"role": "user", "content": "Describe a software developer as JSON."}], json_schema=PERSON,
                    max_tokens=120, temperature=0.8, seed=seed)
        if c.finish_reason == "eos":
            ended += 1
            try:
                jsonschema.validate(json.loads(c.text), PERSON)
                ok += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return {"n": n, "ended": ended, "valid": ok}


class _Timed:
    """Time spent computing masks (llguidance + unpacking) during one generation."""

    def __init__(self) -> None:
        self.t = 0.0
        self.n = 0
        self._orig = grammar_mod.GrammarConstraint.mask

    def __enter__(self):
        orig, me = self._orig, self

        def mask(c):
            cached = c._masks[-1] is not None
            t0 = time.perf_counter()
            m = orig(c)
            if not cached:
                me.t += time.perf_counter() - t0
                me.n += 1
            return m

        grammar_mod.GrammarConstraint.mask = mask
        return self

    def __exit__(self, *exc):
        grammar_mod.GrammarConstraint.mask = self._orig


class _Truncating:
    """Drafts without the grammar, cut at the first forbidden token (greedy: exact)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name, self.vocab_fingerprint, self.weight_bytes, self.n_classes = inner.name + "+cut", None, 0, \
            inner.n_classes

    def hint(self, context, logits=None):
        return self.inner.hint(context, logits)

    def propose(self, context, gamma, sampling, rng, constraint=None):
        toks, q = self.inner.propose(context, gamma, sampling, rng)
        keep = 0
        for x in toks:
            if constraint is None or not constraint.continuing_mask()[x]:
                break
            constraint.consume(x)
            keep += 1
        if constraint is None:
            keep = len(toks)
        return toks[:keep], (q[:keep] if (q is not None and keep) else None)

    def reset(self):
        self.inner.reset()

    def close(self):
        self.inner.close()


def run_one(rt, messages, *, tokens, schema, gamma, drafter=None) -> dict:
    plan = rt.plan_chat(messages, json_schema=schema)
    saved = rt.drafter
    if drafter is not None:
        rt.drafter = drafter
    stats = GenStats()
    try:
        with _Timed() as timed:
            out = [s.token for s in rt.stream_tokens(plan.prompt_tokens, max_tokens=tokens, temperature=0,
                                                     gamma=gamma, stats=stats, constraint=plan.constraint)]
    finally:
        rt.drafter = saved
    return {"tokens": len(out), "tok_s": stats.tokens_per_s, "acceptance": stats.acceptance_rate,
            "mask_ms_per_token": 1e3 * timed.t / max(1, len(out)), "masks": timed.n,
            "text": rt.tokenizer.detokenize(out).decode("utf-8", "replace")}


def llama_server_rows(binary: str, rts: dict, tokens: int, threads: int, rounds: int) -> dict:
    """llama.cpp's own server on the same files, prompt, threads and context: decode tok/s (its timings)
    without and with the same JSON schema (`json_schema` in the /completion request), greedy."""
    import os
    import urllib.request

    rows = {}
    for key, rt in rts.items():
        env = dict(os.environ, LD_LIBRARY_PATH=str(Path(binary).parent))
        with llama_server(binary, rt.target.path, threads=threads, extra=["-c", "1024", "-np", "1", "--no-webui"],
                          env=env) as server:
            server.wait_ready()
            port = server.url.rsplit(":", 1)[1]
            prompt = rt.tokenizer.apply_chat_template(ASK)
            for label, schema in (("plain", None), ("schema", RECORDS)):
                rates = []
                for _ in range(rounds):
                    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": False}
                    if schema is not None:
                        body["json_schema"] = schema
                    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                                 headers={"Content-Type": "application/json"})
                    out = json.loads(urllib.request.urlopen(req, timeout=600).read())
                    rates.append(out["timings"]["predicted_per_second"])
                rows[f"llama-server {key} {label}"] = {"tok_s": statistics.median(rates), "acceptance": 0.0,
                                                       "mask_ms_per_token": 0.0, "tokens": tokens,
                                                       "sample": out.get("content", "")[:160]}
    return rows


def apply_cost(n_vocab: int, reps: int = 200) -> float:
    logits = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
    mask = np.random.default_rng(1).random(n_vocab) < 0.3
    t0 = time.perf_counter()
    for _ in range(reps):
        apply_mask(logits, mask)
    return 1e3 * (time.perf_counter() - t0) / reps


def main() -> None:
    ap = arg_parser(__doc__, rounds=3, tokens=96, threads=2, gamma=3, models="smollm2,qwen", out="structured")
    ap.add_argument("--llama-server", default=None, help="a llama-server binary (built from the llama-cpp-python "
                    "sdist, see bench/spec.py): the peer, run on the same files after edgerun's rounds")
    ap.add_argument("--valid-n", type=int, default=8, help="sampled answers per model checked with jsonschema")
    a = ap.parse_args()

    import edgerun
    from edgerun.speculative.drafters import PromptLookupDrafter

    results: dict = {"rounds": a.rounds, "tokens": a.tokens, "threads": a.threads, "gamma": a.gamma, "rows": {}}
    systems = []          # (label, model key, messages, schema?, gamma, drafter factory)
    rts = {}
    if "smollm2" in a.models:
        rts["smollm2"] = edgerun.load(SMALL, draft="none", n_threads=a.threads, n_ctx=1024)
        systems += [("smollm2 plain", "smollm2", ASK, None, 0, None),
                    ("smollm2 schema", "smollm2", ASK, RECORDS, 0, None),
                    ("smollm2 lookup", "smollm2", COPY_ASK, None, a.gamma, "lookup"),
                    ("smollm2 lookup+schema (masked)", "smollm2", COPY_ASK, RECORDS, a.gamma, "lookup"),
                    ("smollm2 lookup+schema (cut)", "smollm2", COPY_ASK, RECORDS, a.gamma, "lookup-cut")]
    if "qwen" in a.models:
        rts["qwen"] = edgerun.load(TARGET, draft=DRAFT, n_threads=a.threads, n_ctx=1024, gamma=a.gamma)
        systems += [("qwen1.5b plain", "qwen", ASK, None, 0, None),
                    ("qwen1.5b schema", "qwen", ASK, RECORDS, 0, None),
                    ("qwen pair", "qwen", ASK, None, a.gamma, "model"),
                    ("qwen pair+schema (masked)", "qwen", ASK, RECORDS, a.gamma, "model"),
                    ("qwen pair+schema (cut)", "qwen", ASK, RECORDS, a.gamma, "model-cut"),
                    ("qwen lookup+schema (masked)", "qwen", COPY_ASK, RECORDS, a.gamma, "lookup"),
                    ("qwen lookup+schema (cut)", "qwen", COPY_ASK, RECORDS, a.gamma, "lookup-cut")]
    for rt in rts.values():                     # warm: the llguidance vocabulary is built once per tokenizer
        t0 = time.perf_counter()
        rt.plan_chat(ASK, json_schema=RECORDS)
        results.setdefault("vocab_build_s", {})[rt.model_name] = round(time.perf_counter() - t0, 2)
    for key, rt in rts.items():                 # warm: the first generation pays for page faults and caches
        run_one(rt, ASK, tokens=8, schema=None, gamma=0)
        run_one(rt, ASK, tokens=8, schema=RECORDS, gamma=0)
    runs: dict[str, list] = {label: [] for label, *_ in systems}
    for r in range(a.rounds):
        for label, key, msgs, schema, gamma, dr in systems:
            rt = rts[key]
            drafter = None
            if dr is not None and dr.startswith("lookup"):
                drafter = PromptLookupDrafter()
            elif dr is not None:
                drafter = rt.drafter
            if dr is not None and dr.endswith("-cut"):
                drafter = _Truncating(drafter)
            runs[label].append(run_one(rt, msgs, tokens=a.tokens, schema=schema, gamma=gamma, drafter=drafter))
            print(f"round {r + 1}: {label}: {runs[label][-1]['tok_s']:.1f} tok/s", file=sys.stderr)
    for label, rs in runs.items():
        results["rows"][label] = {
            "tok_s": statistics.median(x["tok_s"] for x in rs),
            "acceptance": statistics.median(x["acceptance"] for x in rs),
            "mask_ms_per_token": statistics.median(x["mask_ms_per_token"] for x in rs),
            "tokens": rs[0]["tokens"], "sample": rs[0]["text"][:160]}
    if a.llama_server:
        results["rows"].update(llama_server_rows(a.llama_server, rts, a.tokens, a.threads, a.rounds))
    results["validity"] = {rt.model_name: validity(rt, a.valid_n) for rt in rts.values()}
    results["apply_mask_ms"] = {str(rt.target.n_vocab): apply_cost(rt.target.n_vocab) for rt in rts.values()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    rows = results["rows"]
    print(f"\n{'system':34s} {'tok/s':>7s} {'vs plain':>8s} {'accept':>7s} {'mask ms/tok':>11s}")
    for label, row in rows.items():
        base = rows.get("qwen1.5b plain" if "qwen" in label else "smollm2 plain")
        ratio = row["tok_s"] / base["tok_s"] if base else float("nan")
        print(f"{label:34s} {row['tok_s']:7.1f} {ratio:8.2f} {row['acceptance']:7.1%} {row['mask_ms_per_token']:11.3f}")
    print(f"apply_mask per call (ms): {results['apply_mask_ms']}; vocabulary build (s): {results['vocab_build_s']}")
    for name, v in results["validity"].items():
        print(f"{name}: {v['valid']}/{v['n']} sampled answers under the schema parse and validate "
              f"({v['ended']} ended within 120 tokens)")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
