"""Cold start and footprint against llama.cpp's own programs, whole processes, alternating (issue 57).

Per model, in one run, alternating edgerun and its llama.cpp counterpart on the same file, threads,
prompt and greedy decoding:
- `edgerun generate PROMPT -n 16 --temperature 0` against `llama-completion -no-cnv --temp 0 -n 16`: wall
  time, peak RSS, and edgerun's time to first token (`--json` stats: prefill);
- the floor: `python -c "import numpy, llama_cpp, click"` (the interpreter and the libraries a one-shot
  needs, llama.cpp's shared libraries included), and the server's, with fastapi, uvicorn and pydantic;
- `edgerun serve` start to /health 200 against `llama-server` (with `-md` where edgerun drafts).

edgerun's bytecode is compiled first (`python -m compileall`), as pip does when it installs the wheel: a
checkout run with PYTHONDONTWRITEBYTECODE set would otherwise compile every module at every start.

    nice python bench/coldstart.py --llama-bin <llama.cpp build>/bin [--models smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct]
        [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness

PROMPT = "The capital of France is"


def peak_of(cmd: list[str], env=None) -> tuple[float, float, str]:
    """(wall s, the child's peak RSS in MiB sampled every 10 ms, stdout) of one whole process."""
    import psutil

    t0 = time.perf_counter()
    p = psutil.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    peak = 0
    while p.poll() is None:
        try:
            peak = max(peak, p.memory_info().rss)
        except psutil.Error:
            break
        time.sleep(0.01)
    out = p.stdout.read()
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed with {p.returncode}")
    return wall, peak / 2**20, out


def serve_ready(cmd: list[str], url: str) -> float:
    t0 = time.perf_counter()
    with harness.Proc("server", cmd, url) as p:
        p.wait_ready(timeout=600)
        return time.perf_counter() - t0


def main() -> None:
    ap = harness.arg_parser(__doc__, models="smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct", rounds=5,
                            threads=2, out="coldstart")
    ap.add_argument("--llama-bin", required=True, help="folder with llama-completion and llama-server")
    a = ap.parse_args()
    from edgerun.registry.manifest import default_draft_for
    from edgerun.resolve import resolve_model

    bin_ = Path(a.llama_bin)
    import edgerun
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(edgerun.__file__).parent)], check=True)
    rows, result = [], {"threads": a.threads, "rounds": a.rounds, "models": {}}
    floor = [peak_of([sys.executable, "-c", "import numpy, llama_cpp, click"])[0] for _ in range(a.rounds)]
    result["floor_s"] = statistics.median(floor)
    floor = [peak_of([sys.executable, "-c", "import numpy, llama_cpp, click, fastapi, uvicorn, pydantic"])[0]
             for _ in range(a.rounds)]
    result["serve_floor_s"] = statistics.median(floor)        # the same with the server's web stack
    for model in a.models.split(","):
        path = resolve_model(model, pull=False)
        draft = default_draft_for(model)
        draft_path = resolve_model(draft, pull=False) if draft else None
        er = harness.edgerun_cmd("generate", PROMPT, "--model", model, "-n", "16", "--temperature", "0",
                                 "--threads", str(a.threads), "--no-pull", "--json")
        lc = [str(bin_ / "llama-completion"), "-m", str(path), "-p", PROMPT, "-n", "16", "--temp", "0",
              "-t", str(a.threads), "-no-cnv", "-fa", "on", "--no-warmup"]
        e_wall, e_peak, l_wall, l_peak, ttft = [], [], [], [], []
        for _ in range(a.rounds):
            w, pk, out = peak_of(er)
            e_wall.append(w)
            e_peak.append(pk)
            stats = json.loads(out.strip().splitlines()[-1])        # generate --json: the stats at the top level
            ttft.append(stats.get("t_prefill_s", float("nan")))
            w, pk, _ = peak_of(lc)
            l_wall.append(w)
            l_peak.append(pk)
        port = harness.free_port()
        es = harness.edgerun_cmd("serve", "--model", model, "--threads", str(a.threads), "--no-pull",
                                 "--port", str(port))
        ls_extra = ["-fa", "on"] + (["-md", str(draft_path)] if draft_path else [])
        s_e, s_l = [], []
        for _ in range(a.rounds):
            s_e.append(serve_ready(es, f"http://127.0.0.1:{port}"))
            lp = harness.free_port()
            s_l.append(serve_ready([str(bin_ / "llama-server"), "-m", str(path), "-t", str(a.threads), "--host",
                                    "127.0.0.1", "--port", str(lp), *ls_extra], f"http://127.0.0.1:{lp}"))
        m = {k: statistics.median(v) for k, v in dict(edgerun_s=e_wall, llama_completion_s=l_wall,
                                                      edgerun_peak_mib=e_peak, llama_peak_mib=l_peak,
                                                      edgerun_prefill_s=ttft, serve_ready_s=s_e,
                                                      llama_server_ready_s=s_l).items()}
        m["ratio"] = statistics.median(e / l for e, l in zip(e_wall, l_wall))
        m["added_s"] = m["edgerun_s"] - m["llama_completion_s"]
        m["serve_ratio"] = statistics.median(e / l for e, l in zip(s_e, s_l))
        result["models"][model] = m
        rows.append([model, m["edgerun_s"], m["llama_completion_s"], m["ratio"], m["added_s"], m["edgerun_prefill_s"],
                     m["serve_ready_s"], m["llama_server_ready_s"], m["serve_ratio"], m["edgerun_peak_mib"],
                     m["llama_peak_mib"]])
    harness.print_table(["model", "edgerun s", "llama-completion s", "ratio", "added s", "prefill s", "serve ready s",
                         "llama-server s", "ratio", "peak MiB", "llama MiB"], rows,
                        title=f"cold start, medians of {a.rounds} alternating runs; floor (python + numpy + llama_cpp "
                              f"+ click imports) {result['floor_s']:.2f} s, with fastapi + uvicorn + pydantic "
                              f"{result['serve_floor_s']:.2f} s")
    print("wrote", harness.write_result(a.out, result))


if __name__ == "__main__":
    main()
