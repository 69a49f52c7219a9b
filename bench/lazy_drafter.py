"""The drafter loaded when it will be used (speculative/lazy.py): a Qwen one-shot and a service start, before and
after, beside llama.cpp's programs on the same file (issue 57).

Whole processes under /usr/bin/time -v (wall clock and peak RSS), alternating in each round:
- `edgerun generate PROMPT -n 16 --temperature 0 --json` (default `--draft auto`: the paired 0.5B drafter) from
  the tree before (`--before`: a source tree, put first on PYTHONPATH) and from this one;
- `llama-completion -no-cnv --temp 0 -n 16` (no drafter) on the same target file and threads;
- with `--serve`: `edgerun serve --parallel 1` start to /health 200, before and after, and `llama-server -md`.

The tuner's stored state for this device and pair decides whether the drafter is deferred: run one
`edgerun generate` with the pair first (it measures the drafter's step and keeps the tuner's state). Each
edgerun row says what its `--json` stats reported (the `drafter` state; the text, which must not change).

    nice python bench/lazy_drafter.py --llama-bin <llama.cpp build>/bin --before <source tree> [--rounds 3]
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

import harness

PROMPT = "The capital of France is"
MODEL = "qwen2.5-coder-1.5b-instruct"


def timed(cmd: list[str], env=None) -> tuple[float, float, float, str]:
    """(wall s, peak RSS MiB, CPU s (user + system), stdout) of one whole process from /usr/bin/time -v. On a
    shared machine the CPU seconds are the steadier figure: waiting for a core adds wall time, not CPU time."""
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed with {p.returncode}: {p.stderr[-2000:]}")
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", p.stderr)
    h, mnt, s = m.groups()
    wall = int(h or 0) * 3600 + int(mnt) * 60 + float(s)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) / 1024
    cpu = sum(float(re.search(rf"{k} time \(seconds\): ([\d.]+)", p.stderr).group(1)) for k in ("User", "System"))
    return wall, rss, cpu, p.stdout


def ready_s(cmd: list[str], url: str, env=None) -> float:
    """Seconds from the start of a server process to its first /health 200 (polled every 0.5 s)."""
    t0 = time.perf_counter()
    with harness.Proc("server", cmd, url, env=env) as p:
        p.wait_ready(timeout=600)
        return time.perf_counter() - t0


def main() -> None:
    ap = harness.arg_parser(__doc__, rounds=3, threads=2, out="lazy_drafter")
    ap.add_argument("--llama-bin", required=True, help="folder with llama-completion and llama-server")
    ap.add_argument("--before", required=True, help="source tree of edgerun before the change")
    ap.add_argument("--serve", action="store_true", help="also time service starts")
    a = ap.parse_args()
    from edgerun.registry.manifest import default_draft_for
    from edgerun.resolve import resolve_model

    here = str(Path(__file__).resolve().parents[1])
    envs = {"before": {**os.environ, "PYTHONPATH": a.before}, "after": {**os.environ, "PYTHONPATH": here}}
    path = resolve_model(MODEL, pull=False)
    draft_path = resolve_model(default_draft_for(MODEL), pull=False)
    er = harness.edgerun_cmd("generate", PROMPT, "--model", MODEL, "-n", "16", "--temperature", "0",
                             "--threads", str(a.threads), "--no-pull", "--json")
    lc = [str(Path(a.llama_bin) / "llama-completion"), "-m", str(path), "-p", PROMPT, "-n", "16", "--temp", "0",
          "-t", str(a.threads), "-no-cnv", "--no-warmup"]
    runs: dict[str, list] = {"before": [], "after": [], "llama-completion": []}
    for _ in range(a.rounds):
        for who in ("before", "after"):
            w, rss, cpu, out = timed(er, envs[who])
            st = json.loads(out.strip().splitlines()[-1])
            runs[who].append({"wall_s": w, "peak_mib": rss, "cpu_s": cpu, "prefill_s": st["t_prefill_s"],
                              "text": st["text"],
                              "drafter": (st.get("drafter") or {}).get("state", "loaded (before)")})
        w, rss, cpu, _ = timed(lc)
        runs["llama-completion"].append({"wall_s": w, "peak_mib": rss, "cpu_s": cpu})
    result = {"threads": a.threads, "rounds": a.rounds, "model": MODEL, "runs": runs, "medians": {}}
    rows = []
    for who, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s", "peak_mib")}
        if "prefill_s" in rs[0]:
            med["prefill_s"] = statistics.median(r["prefill_s"] for r in rs)
        result["medians"][who] = med
        rows.append([f"generate {who}" if who != "llama-completion" else who, med["wall_s"], med["cpu_s"],
                     med["peak_mib"],
                     med.get("prefill_s"), ",".join(sorted({str(r.get("drafter", "-")) for r in rs})),
                     len({r.get("text") for r in rs})])
    if a.serve:
        port = harness.free_port()
        es = harness.edgerun_cmd("serve", "--model", MODEL, "--threads", str(a.threads), "--no-pull", "--parallel",
                                 "1", "--port", str(port))
        lp = harness.free_port()
        ls = [str(Path(a.llama_bin) / "llama-server"), "-m", str(path), "-md", str(draft_path), "-t", str(a.threads),
              "--host", "127.0.0.1", "--port", str(lp)]
        s = {"before": [], "after": [], "llama-server": []}
        for _ in range(a.rounds):
            for who in ("before", "after"):
                s[who].append(ready_s(es, f"http://127.0.0.1:{port}", envs[who]))
            s["llama-server"].append(ready_s(ls, f"http://127.0.0.1:{lp}"))
        result["serve_ready_s"] = s
        for who, v in s.items():
            rows.append([f"serve to ready, {who}", statistics.median(v), None, None, None, "", None])
    harness.print_table(["what", "wall s", "CPU s", "peak MiB", "prefill s", "drafter", "texts"], rows,
                        title=f"{MODEL}, {a.threads} threads, medians of {a.rounds} alternating rounds")
    print("wrote", harness.write_result(a.out, result))


if __name__ == "__main__":
    main()
