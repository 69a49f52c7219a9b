"""A checkpoint quantized by AutoAWQ itself, imported by `edgerun convert`: perplexity and speed side by side.

    /work/fixvenv/bin/python bench/convert_autoawq.py ~/.cache/edgerun/models/smollm2-135m-instruct.gguf \
        /tmp/edgerun-bench-convert --group 64                                         # step 1 (torch venv)
    python bench/convert.py --work /tmp/edgerun-bench-convert --wiki /tmp/enwiki_sample.txt --windows 16

The float model is the registry SmolLM2-135M dequantized (DATA.md: no package ships float weights).
Step 1 quantizes it with AutoAWQ (GEMM, zero points; group 64, because SmolLM2's hidden size 576 is
not a multiple of 128) calibrated on edgerun's own calibration text, and records AutoAWQ's own
dequantized weights. This script then

- imports the AutoAWQ checkpoint with `edgerun convert` as Q4_1 and as Q5_0 (`--exact`), and as ONNX,
  timing each conversion and its peak RSS (child processes);
- writes AutoAWQ's dequantized weights as an F32 GGUF (same tokenizer and metadata as the import):
  the reference the imports must equal;
- scores every file with edgerun's perplexity (ctx 512, llama-perplexity's scoring; wiki sample and
  held-out code slice as in bench/awq.py; the ONNX directory through the ONNX backend) and pairs each
  import with that reference;
- beside them: edgerun's own AWQ (Q4_0, Q4_1) and round-to-nearest (Q4_0, Q4_1) of the same float model;
- decode speed (greedy, 128 tokens, 2 threads, interleaved rounds) of the imported Q4_1 / Q5_0 and the
  registry file through edgerun's loop.

Writes bench/results/convert.json and prints the tables.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgerun.eval.perplexity import compare# noqa: E402
from edgerun.registry.cache import resolve_model# noqa: E402

_spec = importlib.util.spec_from_file_location("bench_awq", ROOT / "bench" / "awq.py")
bench_awq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_awq)


def edgerun_cli(*args: str) -> dict:
    r = bench_awq.run_child([sys.executable, "-c", "from edgerun.cli import main; main()", *args])
    out = r.pop("stdout")
    try:
        r["report"] = json.loads(out)
    except json.JSONDecodeError:
        r["report"] = out
    return r


def dequant_reference(imported: Path, npz: Path, out: Path) -> Path:
    """AutoAWQ's own dequantized weights (HF names) in an F32 GGUF with the import's metadata and tokenizer."""
    import gguf

    from edgerun.formats.arch import hf_name, permute_qk
    from edgerun.formats.gguf import GGUFSource, KV, TensorPlan, write_gguf

    if out.exists():
        return out
    src = GGUFSource(imported)
    cfg = src.cfg
    deq = np.load(npz)
    kvs = [KV(k.key, k.value, k.vtype, k.sub_type) for k in src.kv()
           if not k.key.startswith(("GGUF.", "general.architecture", "general.alignment", "general.file_type",
                                    "general.quantization_version", "edgerun."))]

    def tensor(n: str) -> np.ndarray:
        m = hf_name(cfg, n).rsplit(".", 1)[0]
        if m in deq.files:
            a = deq[m].astype(np.float32)
            if ".attn_q." in n or ".attn_k." in n:
                a = permute_qk(a, cfg.n_head if ".attn_q." in n else cfg.n_head_kv)
            return a
        return src.tensor(n)

    names = src.tensor_names()
    plan = [TensorPlan(n, tuple(int(x) for x in reversed(src._tensors[n].shape)), gguf.GGMLQuantizationType.F32)
            for n in names]
    write_gguf(out, cfg.arch, kvs, plan, (tensor(n) for n in names), 0)
    return out


def decode_speed(paths: dict[str, Path], threads: int, tokens: int, rounds: int) -> dict:
    from edgerun.runtime import load

    prompt = "The history of the Roman Empire"
    out = {k: [] for k in paths}
    for _ in range(rounds):
        for k, p in paths.items():
            with load(str(p), draft="none", n_threads=threads, n_ctx=512, pull=False) as rt:
                c = rt.generate(prompt, max_tokens=tokens, temperature=0)
                out[k].append(c.stats.tokens_per_s)
    return {k: {"tok_s": float(np.median(v)), "runs": v} for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/edgerun-bench-convert")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--wiki", required=True)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--own", default="awq:q4_0,awq:q4_1,rtn:q4_0,rtn:q4_1",
                    help="edgerun's own files to make from the float model and score beside ('' for none; "
                         "AWQ is the slowest part)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "convert.json"))
    a = ap.parse_args()
    work = Path(a.work)
    src = resolve_model(a.model, pull=True)
    if not (work / "awq" / "config.json").is_file():
        sys.exit(f"{work}/awq missing: run bench/convert_autoawq.py first (see the docstring)")
    res: dict = {"machine": platform.processor() or platform.machine(), "threads": a.threads, "windows": a.windows,
                 "autoawq": json.loads((work / "autoawq.json").read_text()), "convert": {}, "ppl": {}, "pairs": {}}
    files = {}
    for name, extra in (("imported Q4_1", []), ("imported Q5_0 (--exact)", ["--exact"])):
        out = work / (name.split()[1].lower() + ".gguf")
        out.unlink(missing_ok=True)
        res["convert"][name] = edgerun_cli("convert", str(work / "awq"), str(out), "--json", *extra)
        files[name] = out
    onnx = work / "onnx"
    res["convert"]["imported ONNX"] = edgerun_cli("convert", str(work / "awq"), str(onnx), "--force", "--json")
    files["imported ONNX (accuracy 4)"] = onnx
    files["AutoAWQ dequantized (F32)"] = dequant_reference(files["imported Q5_0 (--exact)"], work / "awq_dequant.npz",
                                                           work / "autoawq-dequant-f32.gguf")
    own = [tuple(x.split(":")) for x in a.own.split(",") if x]
    if own:
        ref = bench_awq.float_reference(src, work / "float-f32.gguf")
    for method, fmt in own:
        out = work / f"own-{method}-{fmt}.gguf"
        if not out.exists():
            res["convert"][f"edgerun {method} {fmt}"] = bench_awq.quantize(ref, out, method, fmt, "builtin")
        files[f"edgerun {method.upper()} {fmt.upper()}"] = out
    texts = bench_awq.eval_texts(a.wiki)
    scores = {k: bench_awq.score_texts(p, texts, a.windows, a.threads) for k, p in files.items()}
    for k, s in scores.items():
        res["ppl"][k] = {t: r.ppl for t, r in s.items()}
    ref_key = "AutoAWQ dequantized (F32)"
    for k in files:
        for t in texts:
            try:
                res["pairs"].setdefault(k, {})[t] = compare(scores[k][t], scores[ref_key][t])
            except Exception as e:                      # different tokenizers: not paired (recorded)
                res["pairs"].setdefault(k, {})[t] = str(e)
    res["speed"] = decode_speed({"imported Q4_1": files["imported Q4_1"],
                                 "imported Q5_0": files["imported Q5_0 (--exact)"],
                                 "registry Q4_1 (SmolLM2 as shipped)": src}, a.threads, 128, a.rounds)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    print(f"{'file':32} {'wiki':>9} {'code':>9}   vs AutoAWQ dequantized (paired, 95%)")
    for k in files:
        pr = res["pairs"][k]
        pair = "  ".join(f"{t} {v[0]:.4f} [{v[1]:.4f}, {v[2]:.4f}]" if isinstance(v, tuple) else f"{t} (not paired)"
                         for t, v in pr.items())
        print(f"{k:32} {res['ppl'][k]['wiki']:9.3f} {res['ppl'][k]['code']:9.3f}   {pair}")
    for k, c in res["convert"].items():
        if "wall_s" in c:
            print(f"{k:32} wall {c['wall_s']:.1f} s, peak RSS {c['peak_rss_mb']:.0f} MB")
    for k, v in res["speed"].items():
        print(f"{k:36} {v['tok_s']:.1f} tok/s (median of {len(v['runs'])})")
    print(f"wrote {a.out} at {time.strftime('%Y-%m-%d %H:%M:%S')}")


if __name__ == "__main__":
    main()
