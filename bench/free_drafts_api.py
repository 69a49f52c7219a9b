"""Drafter settings side by side through the Python API, interleaved in one process (docs/free_drafts.md).

Each prompt of the chosen workloads of bench/free_drafts_serve.py goes to one Runtime per `--drafts` setting in
turn (greedy), so all settings see the same machine at the same time; per answer: tokens, drafts made and kept,
decode tok/s. `--free-gamma-max N` caps suffix lookup's drafts at N (SpeculativeArgs.free_gamma_max; 8 = no
longer than a model's) and `--no-earn` lets long drafts start at full length (the loop's EARNED_START set to the
cap): the long-draft comparison of free_drafts.md. JSON out, a table printed.

    python bench/free_drafts_api.py [--model qwen2.5-coder-1.5b-instruct] [--drafts none,suffix,auto]
        [--workloads c,d,e] [--rounds 1] [--max-tokens 900] [--free-gamma-max 24] [--no-earn] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--drafts", default="none,suffix,auto")
    ap.add_argument("--workloads", default="c,d,e")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=900)
    ap.add_argument("--free-gamma-max", type=int, default=None)
    ap.add_argument("--no-earn", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "free_drafts_api.json"))
    a = ap.parse_args()

    spec = importlib.util.spec_from_file_location("free_drafts_serve", HERE / "free_drafts_serve.py")
    serve_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_bench)
    import edgerun.config as config
    import edgerun.generate as generate
    from edgerun import load

    if a.free_gamma_max is not None:       # the default every SpeculativeArgs of this process is built with
        fields = {f.name: f for f in dataclasses.fields(config.SpeculativeArgs)}
        defaults = list(config.SpeculativeArgs.__init__.__defaults__)
        names = [n for n in fields if fields[n].default is not dataclasses.MISSING]
        defaults[names.index("free_gamma_max")] = a.free_gamma_max
        config.SpeculativeArgs.__init__.__defaults__ = tuple(defaults)
    if a.no_earn:
        generate.EARNED_START = config.GAMMA_LIMIT
    work = serve_bench.workloads("".join(a.workloads.split(",")))
    rts = {d: load(a.model, draft=d, n_threads=a.threads) for d in a.drafts.split(",")}
    rows = []
    try:
        for rnd in range(a.rounds):
            for w in work:
                for d, rt in rts.items():
                    s = rt.chat(w["messages"], max_tokens=a.max_tokens, temperature=0).to_dict()
                    row = dict(round=rnd, draft=d, workload=w["w"], prompt=w["name"], tokens=s["n_tokens"],
                               drafted=s["n_drafted"], accepted=s["n_accepted"], tps=s["tokens_per_s"])
                    rows.append(row)
                    print(f"{rnd} {d:8s} {w['name']:14s} {row['tokens']:4d} tok  drafted {row['drafted']:4d}  "
                          f"kept {row['accepted']:4d}  {row['tps']:6.1f} tok/s", flush=True)
    finally:
        for rt in rts.values():
            rt.close()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
