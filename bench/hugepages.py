"""Huge pages for llama.cpp's memory: the same model loaded twice in one process, on small and on huge pages.

Both backends are edgerun's llama.cpp backend over the same file, threads and context; one loaded with
huge_pages off (llama.cpp's own allocation: 4 KiB pages under THP's `madvise` mode, as llama-server runs),
one with it on (the default: the load's anonymous memory collapsed into 2 MiB pages, util/hugepages.py).
They decode the same greedy tokens with edgerun's loop, alternating run by run (off, on, off, ...) so the
machine's drift hits both alike; the rate excludes the prompt. Also reports, per backend, how much memory
was collapsed and the AnonHugePages the kernel shows for the process. Writes bench/results/hugepages.json.

    python bench/hugepages.py [--model qwen2.5-coder-1.5b-instruct@spec] [--tokens 64] [--repeats 8] [--threads 2]
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import arg_parser, geomean_interval, print_table, timed_tokens, write_result  # noqa: E402

PROMPT = "def quicksort(items):\n    \"\"\"Sort a list with quicksort and explain each step.\"\"\"\n"


def anon_huge_mib() -> float:
    text = Path("/proc/self/smaps_rollup").read_text()
    return next(int(line.split()[1]) for line in text.splitlines() if line.startswith("AnonHugePages:")) / 1024


def decode_rate(backend, prompt: list[int], n: int) -> tuple[float, list[int]]:
    from edgerun.config import SamplingArgs
    from edgerun.generate import generate

    backend.truncate(0)
    t = timed_tokens(generate(backend, prompt, SamplingArgs(temperature=0.0), max_tokens=n, is_eog=lambda t: False))
    return t.rate, t.tokens


def main() -> None:
    ap = arg_parser(__doc__, model="qwen2.5-coder-1.5b-instruct@spec", tokens=64, repeats=8, threads=2, ctx=1024,
                    out="hugepages")
    a = ap.parse_args()
    logging.basicConfig(format="%(message)s")
    logging.getLogger("edgerun.util.hugepages").setLevel(logging.INFO)     # prints how long the collapse took

    from edgerun.backends.llamacpp import LlamaCppBackend
    from edgerun.config import BackendArgs
    from edgerun.resolve import resolve_model

    path = resolve_model(a.model)
    backends, huge_mib, load_s = {}, {}, {}
    for huge in (False, True):
        before = anon_huge_mib()
        t0 = time.perf_counter()
        backends[huge] = LlamaCppBackend(path, BackendArgs(n_ctx=a.ctx, n_threads=a.threads, huge_pages=huge))
        load_s[huge] = time.perf_counter() - t0
        print(f"loaded huge_pages={huge} in {load_s[huge]:.1f} s: collapsed "
              f"{(backends[huge].huge.settle() if backends[huge].huge else 0) / 2**20:.0f} MiB, AnonHugePages +{anon_huge_mib() - before:.0f} MiB")
        huge_mib[huge] = backends[huge].huge_bytes / 2**20
    prompt = backends[False].tokenizer.tokenize(PROMPT, add_bos=False)
    for b in backends.values():
        decode_rate(b, prompt, 8)                     # warm-up: page in what is mapped from the file

    rates = {False: [], True: []}
    same = True
    for i in range(a.repeats):
        order = (False, True) if i % 2 == 0 else (True, False)
        toks = {}
        for huge in order:
            r, toks[huge] = decode_rate(backends[huge], prompt, a.tokens)
            rates[huge].append(r)
        same &= toks[False] == toks[True]
    ratios = [h / s for h, s in zip(rates[True], rates[False])]
    gm, lo, hi = geomean_interval(ratios)
    result = {"model": a.model, "threads": a.threads, "tokens": a.tokens, "repeats": a.repeats, "ctx": a.ctx,
              "small_pages_tok_s": rates[False], "huge_pages_tok_s": rates[True], "ratio_per_pair": ratios,
              "ratio_geomean": gm, "ratio_95": [lo, hi],
              "collapsed_mib": huge_mib[True], "load_s_small_pages": load_s[False], "load_s_huge_pages": load_s[True],
              "same_tokens": same}
    out = write_result(Path(a.out), result)
    print_table(["pair", "small pages tok/s", "huge pages tok/s", "ratio"],
                [[str(i), s, h, r] for i, (s, h, r) in enumerate(zip(rates[False], rates[True], ratios))], fmt=".3f")
    print(f"huge / small pages: {gm:.3f} [{result['ratio_95'][0]:.3f}, {result['ratio_95'][1]:.3f}] "
          f"(geometric mean, ~95% interval; {sum(r > 1 for r in ratios)}/{len(ratios)} pairs > 1; "
          f"same greedy tokens: {same})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
