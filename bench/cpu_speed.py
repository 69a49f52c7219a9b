"""Speculation that wins on a CPU board: the pair stored for speed against llama.cpp, in one interleaved run.

For every workload (code / prose prompt x greedy / temperature 0.7 x 128 / 32 tokens, plus prompt lookup on
sampled prose) and every round, each system decodes the same prompt in turn:

  llama.cpp plain, registry file     llama-completion on the registry target (the baseline)
  llama.cpp plain, spec file         llama-completion on the speculation-ready target (NAME@spec)
  llama.cpp speculative              llama-speculative-simple on the speculation-ready pair (n_draft 3)
  edgerun plain, registry file       edgerun's decode loop, gamma 0, registry target
  edgerun plain                      gamma 0 on the speculation-ready target
  edgerun gamma=k                    fixed gamma on the speculation-ready pair (or lookup)
  edgerun plain, fresh               gamma 0 (--draft none) in a fresh Runtime per run, as a new CLI process
  llama.cpp / edgerun plain, drafter plain decoding of the speculation-ready drafter alone (greedy code
                                     workloads): the loop's draft step against llama.cpp's own
  edgerun auto                       the gamma tuner, a fresh Runtime per run (as a new CLI process starts:
                                     what earlier runs learned comes from the tuner's store on disk; the
                                     store of the pair is emptied when the bench starts); auto/plain is
                                     auto over "plain, fresh" (both pay a cold context)

Rates exclude prefill (llama.cpp's "eval time" / "decoded ... speed" lines; edgerun's GenStats.tokens_per_s).
The table gives medians over rounds and ratios to llama.cpp plain on the registry file; `auto/plain` is
edgerun auto over edgerun plain on the same file. With --ppl-windows, the registry target and the
speculation-ready target are also scored (ctx 512, the first N windows, paired 95% intervals) on the
Wikipedia sample (--wiki, written by bench/wiki_sample.py) and the stdlib code slice of bench/awq.py.
With --exact-threads 1, greedy speculative output is compared with greedy plain output at 1 thread.

    nice python bench/cpu_speed.py --tools DIR_WITH_LLAMA_CPP_BINARIES [--rounds 2] [--threads 2]
        [--gammas 1,2,3,4] [--workloads code-greedy-128,...] [--ppl-windows 8 --wiki /tmp/enwiki_sample.txt]
        [--exact-threads 1]

The models are registry names; the speculation-ready variants are made on first use (`edgerun pull
NAME --variant spec`). llama.cpp's tools are built from the llama-cpp-python sdist (bench/spec.py says how).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import print_table, write_result  # noqa: E402
from workloads import CODE_PROMPTS, DRAFT, TARGET  # noqa: E402

PROSE = [{"role": "user", "content": "Explain in a few paragraphs what a hash table is, how it handles "
                                     "collisions, and when a programmer should prefer a balanced tree instead."}]

WORKLOADS = {   # name -> (prompt kind, temperature, tokens, drafter)
    "code-greedy-128": ("code", 0.0, 128, "pair"), "code-greedy-32": ("code", 0.0, 32, "pair"),
    "code-t0.7-128": ("code", 0.7, 128, "pair"), "code-t0.7-32": ("code", 0.7, 32, "pair"),
    "prose-greedy-128": ("prose", 0.0, 128, "pair"), "prose-greedy-32": ("prose", 0.0, 32, "pair"),
    "prose-t0.7-128": ("prose", 0.7, 128, "pair"), "prose-t0.7-32": ("prose", 0.7, 32, "pair"),
    "lookup-prose-t0.7-96": ("summary", 0.7, 96, "lookup"),
}


def prompt_text(kind: str, tokenizer) -> str:
    """The raw prompt text both engines tokenize alike (special tokens parsed): a code prefix, or a chat
    rendered by the model's template."""
    if kind == "code":
        return CODE_PROMPTS[0]
    from workloads import summarise_prompt

    content = PROSE[0]["content"] if kind == "prose" else summarise_prompt()
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


# ---------------------------------------------------------------------------------- llama.cpp

def llama_completion(tools: Path, model: Path, prompt_file: Path, n: int, temp: float, threads: int) -> dict:
    cmd = [str(tools / "llama-completion"), "-m", str(model), "-f", str(prompt_file), "-n", str(n), "-t", str(threads),
           "-tb", str(threads), "-c", "4096", "-fa", "on", "--temp", str(temp), "--seed", "1", "-no-cnv",
           "--ignore-eos", "-ngl", "0", "--no-display-prompt"]
    out = _run(cmd)
    m = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs.*?([\d.]+) tokens per second", out)
    return {"tok_s": float(m.group(3)), "n_tokens": int(m.group(2))} if m else {"error": out[-800:]}


def llama_speculative(tools: Path, target: Path, draft: Path, prompt_file: Path, n: int, temp: float,
                      threads: int, n_draft: int = 3) -> dict:
    cmd = [str(tools / "llama-speculative-simple"), "-m", str(target), "-md", str(draft), "-f", str(prompt_file),
           "-n", str(n), "-t", str(threads), "-tb", str(threads), "-c", "4096", "-fa", "on", "--temp", str(temp),
           "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_draft), "--spec-draft-n-min", "0",
           "--spec-draft-p-min", "0", "-ngl", "0", "-ngld", "0", "--seed", "1"]
    out = _run(cmd)
    m = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)\s+t/s", out)
    res = {"tok_s": float(m.group(3)), "n_tokens": int(m.group(1))} if m else {"error": out[-800:]}
    m = re.search(r"\baccept\s*=\s*([\d.]+)", out)
    if m:
        res["accept_pct"] = float(m.group(1))
    return res


def _run(cmd: list[str]) -> str:
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(cmd[0]).parent)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    return p.stdout + p.stderr


# ---------------------------------------------------------------------------------- edgerun

def edgerun_run(rt, prompt: str, n: int, temp: float, gamma) -> dict:
    c = rt.generate(prompt, max_tokens=n, temperature=temp, seed=1, gamma=gamma)
    st = c.stats
    return {"tok_s": st.tokens_per_s, "n_tokens": st.n_tokens, "acceptance": st.acceptance_rate,
            "gamma_mean": st.gamma_mean, "tokens": c.tokens}


def perplexities(reg: Path, spec: Path, wiki: str | None, windows: int, threads: int) -> dict:
    from edgerun.eval.perplexity import compare, perplexity
    from edgerun.eval.texts import stdlib_code_text

    texts = {"code": stdlib_code_text(6_400_000)[6_000_000:]}
    if wiki:
        texts["wiki"] = Path(wiki).read_text()
    out = {}
    for name, text in texts.items():
        a = perplexity(reg, text, ctx=512, n_threads=threads, max_windows=windows, text_name=name)
        b = perplexity(spec, text, ctx=512, n_threads=threads, max_windows=windows, text_name=name)
        ratio, lo, hi = compare(b, a)
        out[name] = {"registry": a.ppl, "spec": b.ppl, "ratio": ratio, "ci95": [lo, hi], "windows": a.n_windows}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tools", required=True, type=Path)
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--variant", default="spec")
    ap.add_argument("--spec-files", default=None, help="TARGET.gguf,DRAFT.gguf instead of the variants' files")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gammas", default="1,2,3,4")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--ppl-windows", type=int, default=0)
    ap.add_argument("--wiki", default=None)
    ap.add_argument("--exact-threads", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_speed.json"))
    args = ap.parse_args()

    import edgerun
    from edgerun import resolve
    from edgerun.speculative.drafters import make_drafter  # noqa: F401  (import cost outside the timed runs)

    gammas = [int(g) for g in args.gammas.split(",") if g]
    names = [w for w in args.workloads.split(",") if w]
    reg_t = resolve.resolve_model(args.target)
    if args.spec_files:
        spec_t, spec_d = (Path(x) for x in args.spec_files.split(","))
    else:
        spec_t = resolve.resolve_model(f"{args.target}@{args.variant}")
        spec_d = resolve.resolve_model(f"{args.draft}@{args.variant}")
    th = args.threads
    load = dict(n_threads=th, n_ctx=4096)
    rt_reg = edgerun.load(str(reg_t), draft="none", **load)
    rt_plain = edgerun.load(str(spec_t), draft=str(spec_d), gamma=0, **load)     # gamma per call
    rt_look = edgerun.load(str(spec_t), draft="lookup", gamma=0, **load)
    rt_draft = edgerun.load(str(spec_d), draft="none", **load)
    # the tuner starts from nothing learned, then carries what it learns from run to run (as CLI calls do)
    for rt in (edgerun.load(str(spec_t), draft=str(spec_d), **load), edgerun.load(str(spec_t), draft="lookup", **load)):
        for r in ("greedy", "sampled"):
            rt.tuner_store.path(r).unlink(missing_ok=True)
        rt.close()
    tmp = Path(tempfile.mkdtemp(prefix="cpu-speed-"))
    prompts, files = {}, {}
    for w in names:
        kind = WORKLOADS[w][0]
        prompts[kind] = prompt_text(kind, rt_plain.tokenizer)
        files[kind] = tmp / f"{kind}.txt"
        files[kind].write_text(prompts[kind])

    runs: list[dict] = []
    t_start = time.time()
    for rnd in range(args.rounds):
        for w in names:
            kind, temp, n, drafter = WORKLOADS[w]
            p, f = prompts[kind], files[kind]
            rt = rt_plain if drafter == "pair" else rt_look
            systems = [("llama.cpp plain, registry", lambda: llama_completion(args.tools, reg_t, f, n, temp, th)),
                       ("llama.cpp plain, spec", lambda: llama_completion(args.tools, spec_t, f, n, temp, th))]
            if drafter == "pair":
                systems.append(("llama.cpp speculative", lambda: llama_speculative(args.tools, spec_t, spec_d, f, n,
                                                                                  temp, th)))
            systems += [("edgerun plain, registry", lambda: edgerun_run(rt_reg, p, n, temp, 0)),
                        ("edgerun plain", lambda: edgerun_run(rt, p, n, temp, 0))]
            systems += [(f"edgerun gamma={g}", (lambda g=g: edgerun_run(rt, p, n, temp, g))) for g in gammas]
            if kind == "code" and temp == 0.0:
                systems += [("llama.cpp plain, drafter", lambda: llama_completion(args.tools, spec_d, f, n, temp, th)),
                            ("edgerun plain, drafter", lambda: edgerun_run(rt_draft, p, n, temp, 0))]

            def fresh(draft):       # a new Runtime, as a new CLI process has (cold context, tuner from disk)
                rt_new = edgerun.load(str(spec_t), draft=draft, **load)
                try:
                    return edgerun_run(rt_new, p, n, temp, None)
                finally:
                    rt_new.close()
            systems.append(("edgerun plain, fresh", lambda: fresh("none")))
            systems.append(("edgerun auto", lambda: fresh(str(spec_d) if drafter == "pair" else "lookup")))
            for sys_name, fn in systems:
                r = fn()
                r.update(workload=w, system=sys_name, round=rnd)
                runs.append(r)
                print(f"[{time.time() - t_start:6.0f}s] round {rnd} {w:22s} {sys_name:28s} "
                      f"{r.get('tok_s', float('nan')):7.2f} tok/s"
                      + (f"  acc {r['acceptance']:.2f} gamma {r['gamma_mean']:.2f}" if "acceptance" in r else "")
                      + (f"  ERROR {r['error'][-200:]}" if "error" in r else ""), flush=True)
    result = {"target": args.target, "draft": args.draft, "variant": args.variant, "threads": th,
              "rounds": args.rounds, "files": {"registry": str(reg_t), "spec_target": str(spec_t),
                                               "spec_draft": str(spec_d)}, "runs": runs}
    # greedy speculative == greedy plain, per round, at the bench's threads
    for w in names:
        if WORKLOADS[w][1] == 0.0:
            plain = [r["tokens"] for r in runs if r["workload"] == w and r["system"] == "edgerun plain"]
            for r in runs:
                if r["workload"] == w and r["system"].startswith("edgerun") and "registry" not in r["system"]:
                    r["same_as_plain"] = r["tokens"] == plain[r["round"]]
    if args.exact_threads:
        result["exact"] = exact_check(spec_t, spec_d, prompts.get("code", CODE_PROMPTS[0]), args.exact_threads, gammas)
    if args.ppl_windows:
        result["perplexity"] = perplexities(reg_t, spec_t, args.wiki, args.ppl_windows, th)
    for r in runs:
        r.pop("tokens", None)
    result["summary"] = summarise(runs, names)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(Path(args.out), result)
    print_tables(result)
    print(f"\nwrote {args.out}")


def exact_check(spec_t: Path, spec_d: Path, prompt: str, threads: int, gammas: list[int]) -> dict:
    import edgerun

    rt = edgerun.load(str(spec_t), draft=str(spec_d), gamma=0, n_threads=threads, n_ctx=4096)
    try:
        plain = rt.generate(prompt, max_tokens=128, temperature=0).tokens
        out = {f"gamma={g}": rt.generate(prompt, max_tokens=128, temperature=0, gamma=g).tokens == plain for g in gammas}
        out["auto"] = rt.generate(prompt, max_tokens=128, temperature=0, gamma="auto").tokens == plain
        out["threads"] = threads
        return out
    finally:
        rt.close()


def summarise(runs: list[dict], names: list[str]) -> dict:
    out = {}
    for w in names:
        rows = {}
        for r in runs:
            if r["workload"] == w and "tok_s" in r:
                rows.setdefault(r["system"], []).append(r["tok_s"])
        med = {s: statistics.median(v) for s, v in rows.items()}
        base = med.get("llama.cpp plain, registry")
        out[w] = {s: {"tok_s": m, "x_registry_llamacpp": m / base if base else None} for s, m in med.items()}
        if "edgerun auto" in med and "edgerun plain, fresh" in med:
            out[w]["auto/plain"] = med["edgerun auto"] / med["edgerun plain, fresh"]   # both a fresh Runtime
        if "edgerun auto" in med and "llama.cpp speculative" in med:
            out[w]["auto/llama.cpp speculative"] = med["edgerun auto"] / med["llama.cpp speculative"]
        for ours, theirs, key in (("edgerun plain", "llama.cpp plain, spec", "edgerun plain/llama.cpp plain"),
                                  ("edgerun plain, registry", "llama.cpp plain, registry",
                                   "edgerun/llama.cpp plain, registry"),
                                  ("edgerun plain, drafter", "llama.cpp plain, drafter",
                                   "edgerun/llama.cpp plain, drafter")):
            if ours in med and theirs in med:
                out[w][key] = med[ours] / med[theirs]
    return out


def print_tables(result: dict) -> None:
    s = result["summary"]
    systems = []
    for w in s.values():
        systems += [k for k, v in w.items() if isinstance(v, dict) and k not in systems]
    ratios = ("auto/plain", "auto/llama.cpp speculative", "edgerun plain/llama.cpp plain",
              "edgerun/llama.cpp plain, registry", "edgerun/llama.cpp plain, drafter")
    print()
    print_table(["workload", *systems, *ratios],
                [[w, *(f"{row[k]['tok_s']:.1f} ({row[k]['x_registry_llamacpp']:.2f}x)" if k in row else None
                       for k in systems), *(row.get(k) for k in ratios)] for w, row in s.items()],
                fmt=".3f", markdown=True)
    if "perplexity" in result:
        print()
        print_table(["text", "registry PPL", "spec PPL", "ratio [95% CI]", "windows"],
                    [[t, p["registry"], p["spec"], f"{p['ratio']:.4f} [{p['ci95'][0]:.4f}, {p['ci95'][1]:.4f}]",
                      str(p["windows"])] for t, p in result["perplexity"].items()], fmt=".4f", markdown=True)
    if "exact" in result:
        print(f"\ngreedy speculative == greedy plain at {result['exact']['threads']} thread(s): "
              + ", ".join(f"{k} {v}" for k, v in result["exact"].items() if k != "threads"))


if __name__ == "__main__":
    main()
