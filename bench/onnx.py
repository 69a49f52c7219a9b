"""ONNX backend vs llama.cpp backend on the same Q4_0 weights, with onnxruntime-genai as a peer.

For each model: round-to-nearest Q4_0 GGUF (`edgerun quantize --method rtn`, linear weights Q4_0,
embeddings Q8_0) -> `edgerun export onnx` (a lossless re-pairing of the same blocks). Then, in one run:

- parity: top-1 agreement and logit differences over the first --positions tokens of real text
  (CPython's reference prose, teacher-forced) between the ONNX backend, the llama.cpp backend and
  (--reference) the numpy forward of the dequantized weights; also, as a separate figure, the
  agreement without near-ties (positions where the second engine's top-2 margin is under the mean
  |dlogit|); --parity-detail adds ONNX in fp32 (accuracy_level 1) and llama.cpp without flash
  attention with an fp16 and an f32 K/V cache, to see which approximation dominates;
- decode tokens/s of the same greedy decode loop (edgerun.generate, gamma 0) on each backend, and
  onnxruntime-genai's own greedy loop on the same exported graph (prefill excluded everywhere), all
  with --threads intra-op threads (genai's own default would be half the logical CPUs); median and
  best of --repeats, and CPU seconds per token (all threads of the process);
- lock-step CPU per token (--lockstep N tokens, 1 thread, in a fresh process): an edgerun generate()
  step on the ONNX backend and a genai step alternate token by token, each timed by the CPU clock of
  this thread, so other jobs on the machine cancel out (genai's own loop is C++: this is edgerun's
  whole Python overhead plus the backend's, against none); once as loaded (the ONNX backend puts
  its weights on huge pages, genai does not) and once with every large allocation on huge pages;
- verify cost T(n)/T(1), n = 1..8: one eval of n new positions after a fixed prefix;
- speculative pair (--spec-pair TARGET:DRAFT, both exported): greedy plain vs greedy speculative on
  the ONNX backend (tokens must be identical), a llama.cpp drafter for an ONNX target, and
  onnxruntime-genai's speculative mode with the exported drafter.

Runs alternate between engines so that machine noise hits all alike. Writes
bench/results/onnx.json and prints a table. Needs `pip install onnxruntime-genai` for the peer
(skipped with a note if it is missing).

    python bench/onnx.py [--models smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct]
                         [--spec-pair qwen2.5-coder-1.5b-instruct:qwen2.5-coder-0.5b-instruct | none]
                         [--positions 300] [--tokens 64] [--repeats 3] [--threads 2] [--reference]
                         [--lockstep 128] [--parity-detail] [--parity-only]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# this file is named onnx.py: keep its own directory off sys.path so `import onnx` finds the package
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from bench.harness import print_table, timed_tokens, write_result  # noqa: E402  (bench/harness.py, from the root)
from edgerun.backends.llamacpp import LlamaCppBackend# noqa: E402
from edgerun.backends.onnxrt import OnnxBackend# noqa: E402
from edgerun.config import BackendArgs, QuantArgs, SamplingArgs# noqa: E402
from edgerun.device.costprobe import measure_verify_times  # noqa: E402
from edgerun.eval.agreement import top1_agreement as agreement# noqa: E402
from edgerun.generate import GenStats, generate# noqa: E402
from edgerun.onnx.export import export_onnx
from edgerun.onnx.layout import read_config  # noqa: E402
from edgerun.speculative.drafters import ModelDrafter# noqa: E402
from edgerun.speculative.gamma import FixedGamma# noqa: E402

GREEDY = SamplingArgs(temperature=0)
PROMPT = ("Write a long, detailed essay about the history of the steam engine, from its earliest "
          "designs to the industrial revolution and beyond.\n\n")
CODE_PROMPT = "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"


def parity_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in ("assert", "assignment", "augassign", "break", "class"))


# ------------------------------------------------------------------------------------- preparation

def export_acc1(q: Path, work: Path, n_ctx: int, log) -> Path:
    """The same Q4_0 GGUF exported with accuracy_level 1 (fp32 activations), cached under `work`."""
    out = work / f"{q.stem}.acc1.onnx"
    if not out.exists() or read_config(out).n_ctx < n_ctx:
        export_onnx(q, out, n_ctx=n_ctx, accuracy_level=1, force=out.exists())
        log(f"{q.stem}: accuracy_level 1 export")
    return out


def prepare(name: str, work: Path, n_ctx: int, log) -> tuple[Path, Path]:
    """(Q4_0 GGUF, ONNX export) of a registry model or a local GGUF, cached under `work`."""
    from edgerun.quant.pipeline import quantize
    from edgerun.resolve import resolve_model

    src = Path(name) if Path(name).exists() else resolve_model(name)
    stem = Path(name).stem if Path(name).exists() else name
    q = work / f"{stem}.q4_0.gguf"
    if not q.exists():
        t = time.perf_counter()
        quantize(src, q, QuantArgs(method="rtn", format="q4_0", embed_type="q8_0"))
        log(f"{stem}: RTN Q4_0 in {time.perf_counter() - t:.0f} s")
    out = work / f"{stem}.q4_0.onnx"
    if not out.exists() or read_config(out).n_ctx < n_ctx:
        t = time.perf_counter()
        export_onnx(q, out, n_ctx=n_ctx, force=out.exists())
        log(f"{stem}: ONNX export in {time.perf_counter() - t:.0f} s")
    return q, out


# ------------------------------------------------------------------------------------- measurements

@contextlib.contextmanager
def llama_f32_kv():
    """llama.cpp contexts created inside this block keep K/V in float32 (BackendArgs has no cache type:
    a bench-only switch around the backend's context creation). With flash attention on, llama.cpp's
    CPU attention computes in fp16 whatever the cache type (bit-identical logits): pair it with
    flash_attn=False to see float32 attention."""
    from edgerun import llama_lib

    L = llama_lib.lib()
    create = L.llama_init_from_model

    def init(model, params):
        params.type_k = params.type_v = 0                # GGML_TYPE_F32
        return create(model, params)

    L.llama_init_from_model = init
    try:
        yield
    finally:
        L.llama_init_from_model = create


def parity(gguf_q: Path, onnx_dir: Path, n_pos: int, args: BackendArgs, reference: bool,
           acc1_dir: Path | None = None) -> dict:
    """Teacher-forced logits of the first n_pos tokens of parity_text() on each engine, compared.
    acc1_dir (an accuracy_level 1 export of the same weights) adds the detail runs: ONNX in fp32 and
    llama.cpp without flash attention, with an fp16 and an f32 K/V cache."""
    ob = OnnxBackend(onnx_dir, args)
    toks = ob.tokenizer.tokenize(parity_text())[:n_pos]
    logits = {"onnx": ob.eval(toks)}
    ob.close()
    lb = LlamaCppBackend(gguf_q, args)
    logits["llamacpp"] = lb.eval(toks)
    lb.close()
    pairs = [("onnx", "llamacpp")]
    if acc1_dir is not None:
        ob = OnnxBackend(acc1_dir, args)
        logits["onnx_acc1"] = ob.eval(toks)
        ob.close()
        nofa = dataclasses.replace(args, flash_attn=False)
        lb = LlamaCppBackend(gguf_q, nofa)
        logits["llamacpp_nofa"] = lb.eval(toks)
        lb.close()
        with llama_f32_kv():
            lb = LlamaCppBackend(gguf_q, nofa)
            logits["llamacpp_f32kv_nofa"] = lb.eval(toks)
            lb.close()
        pairs += [("onnx", "llamacpp_nofa"), ("onnx", "llamacpp_f32kv_nofa"), ("onnx_acc1", "llamacpp"),
                  ("onnx_acc1", "llamacpp_f32kv_nofa"), ("llamacpp", "llamacpp_nofa")]
    if reference:
        from edgerun.reference.llama import ReferenceModel

        ref = ReferenceModel.from_gguf(gguf_q, dtype=np.float32)
        logits["reference"] = ref.forward(toks)
        del ref
        pairs += [(k, "reference") for k in logits if k != "reference"]
    return {"positions": len(toks), **{f"{x}_vs_{y}": agreement(logits[x], logits[y]) for x, y in pairs}}


def decode_rate(backend, prompt: list[int], n: int, drafter=None, gamma: int = 0) -> tuple[float, list[int], GenStats]:
    rate, _, toks, stats = decode_run(backend, prompt, n, drafter, gamma)
    return rate, toks, stats


def decode_run(backend, prompt: list[int], n: int, drafter=None, gamma: int = 0):
    """(tokens/s, CPU s per token, tokens, stats) of one greedy generation; timed from the first token."""
    backend.truncate(0)
    stats = GenStats()
    t = timed_tokens(generate(backend, prompt, GREEDY, max_tokens=n, drafter=drafter, policy=FixedGamma(gamma),
                              rng=np.random.default_rng(0), stats=stats))
    return t.rate, t.cpu_per_token, t.tokens, stats


def verify_curve(backend, prefix: list[int], repeats: int, n_max: int = 8) -> dict[int, float]:
    """Median seconds of one eval of n positions after the prompt's length of cached context, n = 1..n_max:
    the runtime's own cost probe (device/costprobe.py), medians instead of its minima."""
    times = measure_verify_times(backend, n_max=n_max, reps=repeats, context=len(prefix))     # [rep, n - 1]
    return {n: float(np.median(times[:, n - 1])) for n in range(1, n_max + 1)}


def genai_model(model_dir: Path, threads: int):
    """onnxruntime-genai's model on the CPU with `threads` intra-op threads for every session in the
    config (its default is half the logical CPUs: 1 on this 2-core machine)."""
    import onnxruntime_genai as og

    cfg = og.Config(str(model_dir))
    cfg.clear_providers()
    sections = json.loads((model_dir / "genai_config.json").read_text())["model"]
    threads_of = {"session_options": {"intra_op_num_threads": threads}}
    cfg.overlay(json.dumps({"model": {k: threads_of for k in ("decoder", "draft") if k in sections}}))
    return og.Model(cfg)


def genai_run(model_dir: Path, prompt: list[int], n: int, threads: int, speculative: int = 0) -> dict:
    import onnxruntime_genai as og

    model = genai_model(model_dir, threads)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    if speculative:
        params.set_speculative_options(max_draft_tokens=speculative)
    g = og.Generator(model, params)
    g.append_tokens(np.asarray([prompt], dtype=np.int32))
    stamps, cpu, toks = [], [], []
    while not g.is_done() and len(toks) < n:
        g.generate_next_token()
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        toks.append(int(g.get_next_tokens()[0]))
    res = {"tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "tokens": toks,
           "cpu_s_per_token": (cpu[-1] - cpu[0]) / (len(cpu) - 1)}
    if speculative:
        st = g.get_speculative_stats()
        res["acceptance_rate"] = float(st.get("acceptance_rate", 0.0))
    return res


def lockstep_cpu(onnx_dir: Path, prompt: list[int], n: int, n_ctx: int) -> dict:
    """Median CPU ms per token, 1 intra-op thread: an edgerun generate() step on a fresh ONNX backend
    and an onnxruntime-genai step on the same graph alternate token by token (thread CPU clock, so
    the load of other jobs cancels out)."""
    import onnxruntime_genai as og

    ob = OnnxBackend(onnx_dir, BackendArgs(n_ctx=n_ctx, n_threads=1))
    model = genai_model(onnx_dir, 1)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n + 1, do_sample=False)
    g = og.Generator(model, params)
    g.append_tokens(np.asarray([prompt], dtype=np.int32))
    steps = generate(ob, prompt, GREEDY, max_tokens=n + 1, rng=np.random.default_rng(0), is_eog=lambda t: False)
    next(steps)                                   # prefill + first token on both sides
    g.generate_next_token()
    e, q, diverged, same = [], [], False, 0
    for _ in range(n):
        if g.is_done():
            break
        t0 = time.thread_time()
        tok = next(steps).token
        t1 = time.thread_time()
        g.generate_next_token()
        t2 = time.thread_time()
        diverged = diverged or tok != int(g.get_next_tokens()[0])
        same += not diverged
        e.append(t1 - t0)
        q.append(t2 - t1)
    steps.close()
    ob.close()
    em, gm = statistics.median(e), statistics.median(q)
    # same_prefix: greedy tokens equal before the first difference (near-ties may differ: see README)
    return {"tokens": len(e), "onnx_ms": 1e3 * em, "genai_ms": 1e3 * gm, "ratio": em / gm, "same_prefix": same}


def lockstep_in_fresh_process(onnx_dir: Path, prompt: list[int], n: int, n_ctx: int, all_huge_pages: bool) -> dict:
    """lockstep_cpu in a new Python process: the engines get fresh memory, not what earlier sessions of
    this run freed. all_huge_pages: glibc backs every large allocation with transparent huge pages
    (GLIBC_TUNABLES=glibc.malloc.hugetlb=1), so genai's weights get them as well as the ONNX backend's
    (which collapses its own after loading): then only the decode loops differ."""
    import subprocess

    env = dict(os.environ)
    if all_huge_pages:
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    job = json.dumps({"onnx_dir": str(onnx_dir), "prompt": prompt, "n": n, "n_ctx": n_ctx})
    out = subprocess.run([sys.executable, __file__, "--lockstep-child", job], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def genai_speculative_dir(target: Path, draft: Path, work: Path, gamma: int) -> Path:
    """A composite genai_config.json: the target's decoder plus the drafter's as model.draft.

    onnxruntime-genai refuses '..' in config paths, so both exports are linked below it.
    """
    d = work / f"genai-spec-{target.name}-{draft.name}"
    d.mkdir(exist_ok=True)
    for link, real in (("target", target), ("draft", draft)):
        if not (d / link).exists():
            (d / link).symlink_to(real.resolve(), target_is_directory=True)
    t = json.loads((target / "genai_config.json").read_text())
    dr = json.loads((draft / "genai_config.json").read_text())
    t["model"]["decoder"]["filename"] = "target/" + t["model"]["decoder"]["filename"]
    t["model"]["draft"] = dict(dr["model"]["decoder"])
    t["model"]["draft"]["filename"] = "draft/" + dr["model"]["decoder"]["filename"]
    t["speculative"] = {"max_draft_tokens": gamma}
    (d / "genai_config.json").write_text(json.dumps(t, indent=1))
    return d


def have_genai() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--spec-pair", default="qwen2.5-coder-1.5b-instruct:qwen2.5-coder-0.5b-instruct",
                    help="TARGET:DRAFT for the speculative runs, or 'none'")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--positions", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reference", action="store_true", help="Also compare with the numpy forward (slow).")
    ap.add_argument("--parity-detail", action="store_true",
                    help="Parity also with ONNX in fp32 (accuracy_level 1) and llama.cpp without flash attention, "
                         "fp16 and f32 K/V cache.")
    ap.add_argument("--parity-only", action="store_true", help="Only the parity runs (no speed, no speculative pair).")
    ap.add_argument("--lockstep", type=int, default=128,
                    help="Tokens of the lock-step CPU comparison with onnxruntime-genai (0: skip).")
    ap.add_argument("--lockstep-child", default=None, help=argparse.SUPPRESS)   # internal: one lock-step job (JSON)
    ap.add_argument("--work", default=None, help="Cache of quantized/exported models (default $EDGERUN_HOME/bench-onnx).")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "onnx.json"))
    a = ap.parse_args()
    if a.lockstep_child:
        job = json.loads(a.lockstep_child)
        print(json.dumps(lockstep_cpu(Path(job["onnx_dir"]), job["prompt"], job["n"], job["n_ctx"])))
        return

    from edgerun.registry.cache import cache_dir

    work = Path(a.work) if a.work else cache_dir() / "bench-onnx"
    work.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    n_ctx = 1024
    args = BackendArgs(n_ctx=n_ctx, n_threads=a.threads, flash_attn=True)
    genai = have_genai()
    if not genai:
        log("onnxruntime-genai is not installed: the peer columns are skipped (pip install onnxruntime-genai)")
    import onnxruntime

    result = {"threads": a.threads, "tokens": a.tokens, "repeats": a.repeats, "onnxruntime": onnxruntime.__version__,
              "genai": __import__("onnxruntime_genai").__version__ if genai else None, "models": {}}

    for name in [m for m in a.models.split(",") if m]:
        q, ox = prepare(name, work, n_ctx, log)
        cfg = read_config(ox)
        r = {"gguf": str(q), "onnx": str(ox), "lossless": cfg.lossless, "weight_bytes": cfg.weight_bytes}
        log(f"{name}: parity over {a.positions} positions")
        acc1 = export_acc1(q, work, n_ctx, log) if a.parity_detail else None
        r["parity"] = parity(q, ox, a.positions, args, a.reference, acc1)
        if a.parity_only:
            result["models"][name] = r
            write_result(Path(a.out), result)
            continue
        ob, lb = OnnxBackend(ox, args), LlamaCppBackend(q, args)
        prompt = lb.tokenizer.tokenize(PROMPT)
        rates = {"onnx": [], "llamacpp": [], "genai": []}
        cpus = {"onnx": [], "llamacpp": [], "genai": []}
        curves = {"onnx": [], "llamacpp": []}
        toks = {}
        for rep in range(a.repeats):
            log(f"{name}: speed round {rep + 1}/{a.repeats}")
            for key, be in (("onnx", ob), ("llamacpp", lb)):
                rate, cpu, toks[key], _ = decode_run(be, prompt, a.tokens)
                rates[key].append(rate)
                cpus[key].append(cpu)
                curves[key].append(verify_curve(be, prompt, 3))
            if genai:
                g = genai_run(ox, prompt, a.tokens, a.threads)
                rates["genai"].append(g["tokens_per_s"])
                cpus["genai"].append(g["cpu_s_per_token"])
                toks["genai"] = g["tokens"]
        ob.close()
        lb.close()
        r["decode_tokens_per_s"] = {k: statistics.median(v) for k, v in rates.items() if v}
        r["decode_tokens_per_s_best"] = {k: max(v) for k, v in rates.items() if v}
        r["decode_cpu_ms_per_token"] = {k: 1e3 * statistics.median(v) for k, v in cpus.items() if v}
        if genai and a.lockstep:
            log(f"{name}: lock-step CPU comparison with onnxruntime-genai, {a.lockstep} tokens")
            r["lockstep_1_thread"] = lockstep_in_fresh_process(ox, prompt, a.lockstep, n_ctx, False)
            r["lockstep_1_thread_all_huge_pages"] = lockstep_in_fresh_process(ox, prompt, a.lockstep, n_ctx, True)
        r["verify_cost"] = {k: {n: statistics.median(c[n] for c in v) / statistics.median(c[1] for c in v)
                                for n in range(1, 9)} for k, v in curves.items()}
        r["verify_t1_ms"] = {k: 1000 * statistics.median(c[1] for c in v) for k, v in curves.items()}
        r["greedy_tokens_equal"] = {"onnx_vs_llamacpp": toks["onnx"] == toks["llamacpp"],
                                    **({"onnx_vs_genai": toks["onnx"] == toks["genai"]} if genai else {})}
        result["models"][name] = r
        write_result(Path(a.out), result)                 # partial results survive an interrupted run

    if a.spec_pair != "none" and not a.parity_only:
        t_name, d_name = a.spec_pair.split(":")
        (tq, tx), (dq, dx) = prepare(t_name, work, n_ctx, log), prepare(d_name, work, n_ctx, log)
        target = OnnxBackend(tx, args)
        prompt = target.tokenizer.tokenize(CODE_PROMPT)
        runs: dict[str, list] = {}
        out_toks = {}

        def record(key, rate, toks, stats=None):
            runs.setdefault(key, []).append(rate)
            out_toks[key] = (toks, None if stats is None else stats.acceptance_rate)

        d_onnx = ModelDrafter(OnnxBackend(dx, args), target)
        d_lcpp = ModelDrafter(LlamaCppBackend(dq, args), target)
        lt = LlamaCppBackend(tq, args)
        d_lt = ModelDrafter(LlamaCppBackend(dq, args), lt)
        gdir = genai_speculative_dir(tx, dx, work, a.gamma) if genai else None
        for rep in range(a.repeats):
            log(f"spec pair: round {rep + 1}/{a.repeats}")
            record("onnx plain", *decode_rate(target, prompt, a.tokens)[:2])
            rate, tk, st = decode_rate(target, prompt, a.tokens, d_onnx, a.gamma)
            record(f"onnx spec (onnx drafter, gamma {a.gamma})", rate, tk, st)
            rate, tk, st = decode_rate(target, prompt, a.tokens, d_lcpp, a.gamma)
            record(f"onnx spec (llama.cpp drafter, gamma {a.gamma})", rate, tk, st)
            record("llama.cpp plain", *decode_rate(lt, prompt, a.tokens)[:2])
            rate, tk, st = decode_rate(lt, prompt, a.tokens, d_lt, a.gamma)
            record(f"llama.cpp spec (llama.cpp drafter, gamma {a.gamma})", rate, tk, st)
            if genai:
                g = genai_run(tx, prompt, a.tokens, a.threads)
                record("genai plain", g["tokens_per_s"], g["tokens"])
                try:
                    g = genai_run(gdir, prompt, a.tokens, a.threads, speculative=a.gamma)
                    runs.setdefault(f"genai spec (gamma {a.gamma})", []).append(g["tokens_per_s"])
                    out_toks[f"genai spec (gamma {a.gamma})"] = (g["tokens"], g.get("acceptance_rate"))
                except Exception as e:  # the peer's own errors: recorded, not fatal
                    out_toks["genai spec error"] = (str(e).splitlines()[0], None)
        plain = out_toks["onnx plain"][0]
        result["spec_pair"] = {
            "target": t_name, "draft": d_name, "gamma": a.gamma,
            "runs": {k: {"tokens_per_s": statistics.median(v),
                         "acceptance_rate": out_toks[k][1],
                         "tokens_equal_onnx_plain": out_toks[k][0] == plain,
                         "tokens_equal_own_plain": out_toks[k][0] == out_toks[
                             "llama.cpp plain" if k.startswith("llama") else
                             "genai plain" if k.startswith("genai") else "onnx plain"][0]}
                     for k, v in runs.items()},
            "errors": {k: v[0] for k, v in out_toks.items() if k.endswith("error")},
        }

    write_result(Path(a.out), result)
    print_report(result)
    print(f"\nwrote {a.out}")


def print_report(r: dict) -> None:
    print(f"\nONNX backend vs llama.cpp backend (same Q4_0 weights), {r['threads']} threads, "
          f"onnxruntime {r['onnxruntime']}, onnxruntime-genai {r['genai']}")
    rows = []
    for name, m in r["models"].items():
        if "decode_tokens_per_s" in m:
            p, d, nan = m["parity"]["onnx_vs_llamacpp"], m["decode_tokens_per_s"], float("nan")
            rows.append([name, p["top1_agreement"], p["mean_abs_diff"], d["onnx"], d["llamacpp"], d.get("genai", nan),
                         d["onnx"] / d["llamacpp"], d["onnx"] / d.get("genai", nan)])
    if rows:
        print_table(["model", "top-1 onnx~llama", "mean|dlogit|", "decode tok/s onnx", "llama.cpp", "genai",
                     "onnx/llama", "onnx/genai"], rows, fmt=".3f")
    for name, m in r["models"].items():
        p, nan = m["parity"], float("nan")
        for k, v in p.items():
            if k != "positions":
                print(f"{name:32} {k:38} top-1 {v['top1_agreement']:.4f} ({v['n_differ']} of {p['positions']} differ), "
                      f"mean |dlogit| {v['mean_abs_diff']:.4f}; without near-ties {v['top1_excluding_near_ties']:.4f} "
                      f"({v['near_ties_excluded']} excluded)")
        if "decode_tokens_per_s" not in m:
            continue
        if "decode_tokens_per_s_best" in m:
            b, c = m["decode_tokens_per_s_best"], m["decode_cpu_ms_per_token"]
            print(f"{'':32} best of {r.get('repeats', '?')}: onnx {b['onnx']:.1f}, llama.cpp {b['llamacpp']:.1f}, "
                  f"genai {b.get('genai', nan):.1f} tok/s; CPU ms/token onnx {c['onnx']:.1f}, "
                  f"llama.cpp {c['llamacpp']:.1f}, genai {c.get('genai', nan):.1f}")
        for key, what in (("lockstep_1_thread", "as loaded"), ("lockstep_1_thread_all_huge_pages", "all on huge pages")):
            ls = m.get(key)
            if ls:
                print(f"{'':32} lock-step, 1 thread, {what}, CPU ms/token: onnx {ls['onnx_ms']:.2f}, genai "
                      f"{ls['genai_ms']:.2f} (onnx/genai {ls['ratio']:.3f}; first {ls['same_prefix']} of "
                      f"{ls['tokens']} tokens equal)")
        for k, c in m["verify_cost"].items():
            print(f"{'':32} T(n)/T(1) {k:9} " + " ".join(f"{c[n]:.2f}" for n in range(1, 9))
                  + f"   (T(1) {m['verify_t1_ms'][k]:.1f} ms)")
    s = r.get("spec_pair")
    if s:
        print(f"\nspeculative pair {s['target']} <- {s['draft']}")
        for k, v in s["runs"].items():
            acc = "" if v["acceptance_rate"] is None else f" acceptance {v['acceptance_rate']:.2f}"
            print(f"  {k:48} {v['tokens_per_s']:7.1f} tok/s{acc}; same tokens as its plain run: "
                  f"{v['tokens_equal_own_plain']}")
        for k, v in s["errors"].items():
            print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
