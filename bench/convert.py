"""A checkpoint quantized by AutoAWQ itself, imported by `edgerun convert`: perplexity and speed side by side.

    /work/fixvenv/bin/python bench/convert_autoawq.py ~/.cache/edgerun/models/smollm2-135m-instruct.gguf \
        /tmp/cv/awq --group 64                                               # step 1 (fixture venv)
    /work/fixvenv/bin/python bench/convert_ct.py ~/.cache/edgerun/models/smollm2-135m-instruct.gguf \
        /tmp/cv/ct-sym --group 64                                            # symmetric W4A16 (speed row)
    /work/fixvenv/bin/python bench/convert_ct.py ~/.cache/edgerun/models/qwen2.5-coder-0.5b-instruct.gguf \
        /tmp/cv/ct-q05 --asym                                                # 0.5B-class (conversion cost)
    python bench/convert.py --work /tmp/cv/awq --wiki /tmp/enwiki_sample.txt --windows 16 \
        --llama-bin <llama.cpp build>/bin --symmetric /tmp/cv/ct-sym --big /tmp/cv/ct-q05 [--also LABEL=WORK]

The float model is the registry SmolLM2-135M dequantized (DATA.md: no package ships float weights).
Step 1 quantizes it with AutoAWQ (GEMM, zero points, its clip search; group 64, because SmolLM2's hidden
size 576 is not a multiple of 128) calibrated on edgerun's own calibration text, and records AutoAWQ's own
dequantized weights. This script then

- imports the AutoAWQ checkpoint with `edgerun convert` as Q4_1, as Q5_0 (`--exact`) and as ONNX (accuracy
  level 4, the default, and 1: fp32 activations), timing each conversion (wall, peak RSS, peak anonymous
  memory of the child process);
- writes AutoAWQ's dequantized weights as an F32 GGUF (the import's tokenizer and metadata): the reference
  the imports must equal; and the float checkpoint AutoAWQ started from, the same way (every row of the
  table is then scored on the same tokens);
- makes edgerun's own AWQ and round-to-nearest files (Q4_0, Q4_1, F16 embedding like the imports'
  float one) and, with --llama-bin, llama.cpp's imatrix Q4_0 (llama-imatrix on the same calibration text,
  llama.cpp's own Q4_0 mix) from that float file;
- scores every file with edgerun's perplexity (ctx 512, llama-perplexity's scoring; wiki sample and
  held-out code slice as in bench/awq.py; an ONNX directory through the ONNX backend), paired against the
  float model and (imports) against AutoAWQ's dequantized weights;
- decode speed (greedy, 128 tokens, 2 threads, interleaved rounds) of the imported Q4_1 / Q5_0, the
  symmetric import (Q4_0) and the registry file, through edgerun's loop and llama-bench on the same file;
- with --big, the conversion time and memory of a 0.5B-class checkpoint (GGUF Q4_1, Q5_0, ONNX).

Writes bench/results/convert.json and prints the tables.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgerun.eval.perplexity import compare# noqa: E402
from edgerun.resolve import resolve_model# noqa: E402
from edgerun.eval.texts import pydoc_text# noqa: E402

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


def dequant_reference(imported: Path, npz: Path | None, out: Path, float_dir: Path | None = None) -> Path:
    """An F32 GGUF with the import's metadata and tokenizer: AutoAWQ's own dequantized linears (HF names, from
    `npz`) with the import's other tensors (AutoAWQ's scaled norms, its embedding), or, with `float_dir`,
    every tensor of the float checkpoint AutoAWQ started from (the float reference, same tokenizer)."""
    import gguf

    from edgerun.formats.arch import hf_name, permute_qk
    from edgerun.formats.gguf import GGUFSource, KV, TensorPlan, write_gguf

    if out.exists():
        return out
    src = GGUFSource(imported)
    cfg = src.cfg
    if float_dir is not None:
        from edgerun.formats.hf import HFSource
        fsrc = HFSource(float_dir)
        deq, names_in = None, set()
    else:
        deq = np.load(npz)
        names_in = set(deq.files)
    kvs = [KV(k.key, k.value, k.vtype, k.sub_type) for k in src.kv()
           if not k.key.startswith(("GGUF.", "general.architecture", "general.alignment", "general.file_type",
                                    "general.quantization_version", "edgerun."))]

    def tensor(n: str) -> np.ndarray:
        m = hf_name(cfg, n).rsplit(".", 1)[0]
        if m in names_in:
            a = deq[m].astype(np.float32)
            if cfg.spec.permute_qk and (".attn_q." in n or ".attn_k." in n):
                a = permute_qk(a, cfg.n_head if ".attn_q." in n else cfg.n_head_kv)
            return a
        return src.tensor(n) if float_dir is None else fsrc.tensor(n).astype(np.float32)

    names = src.tensor_names()
    plan = [TensorPlan(n, tuple(int(x) for x in reversed(src._tensors[n].shape)), gguf.GGMLQuantizationType.F32)
            for n in names]
    write_gguf(out, cfg.arch, kvs, plan, (tensor(n) for n in names), 0)
    return out


def decode_speed(paths: dict[str, Path], threads: int, tokens: int, rounds: int, llama_bin: str | None) -> dict:
    """Greedy decode tok/s of each file through edgerun's loop and, with llama_bin, llama-bench's tg on the
    same file (same threads, flash attention), interleaved over `rounds`."""
    from edgerun.runtime import load

    prompt = "The history of the Roman Empire"
    out = {k: {"edgerun": [], "llama-bench": []} for k in paths}
    for _ in range(rounds):
        for k, p in paths.items():
            with load(str(p), draft="none", n_threads=threads, n_ctx=512, pull=False) as rt:
                c = rt.generate(prompt, max_tokens=tokens, temperature=0)
                out[k]["edgerun"].append(c.stats.tokens_per_s)
            if llama_bin:
                r = subprocess.run([str(Path(llama_bin) / "llama-bench"), "-m", str(p), "-t", str(threads),
                                    "-p", "0", "-n", str(tokens), "-fa", "1", "-r", "1", "-o", "json"],
                                   capture_output=True, text=True, env={**os.environ, "LD_LIBRARY_PATH": llama_bin})
                if r.returncode == 0:
                    out[k]["llama-bench"].append(float(json.loads(r.stdout)[0]["avg_ts"]))
    return {k: {who: {"tok_s": float(np.median(v)), "runs": v} for who, v in d.items() if v} for k, d in out.items()}


def imports(work: Path, label: str, res: dict, exact_too: bool) -> dict[str, Path]:
    """`edgerun convert` of WORK/awq: Q4_1 (and Q5_0, ONNX at accuracy 4 and 1), timed; AutoAWQ's dequantized
    weights as the F32 reference."""
    files = {}
    kinds = [("q4_1", [])] + ([("q5_0", ["--exact"])] if exact_too else [])
    for kind, extra in kinds:
        out = work / f"{kind}.gguf"
        out.unlink(missing_ok=True)
        res["convert"][f"{label} {kind}"] = edgerun_cli("convert", str(work / "awq"), str(out), "--json", *extra)
        files[f"{label} imported {kind.upper()}" + (" (--exact)" if extra else "")] = out
    if exact_too:
        for level in (4, 1):
            onnx = work / f"onnx-acc{level}"
            res["convert"][f"{label} onnx acc{level}"] = edgerun_cli("convert", str(work / "awq"), str(onnx), "--force",
                                                                     "--accuracy-level", str(level), "--json")
            files[f"{label} imported ONNX (accuracy {level})"] = onnx
    files[f"{label} dequantized by AutoAWQ (F32)"] = dequant_reference(
        work / "q4_1.gguf", work / "awq_dequant.npz", work / "autoawq-dequant-f32.gguf")
    return files


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/edgerun-bench-convert",
                    help="bench/convert_autoawq.py's output (float/, awq/, awq_dequant.npz): AutoAWQ as it ships")
    ap.add_argument("--also", action="append", default=[], metavar="LABEL=WORK",
                    help="another AutoAWQ run of the same float model (e.g. no-clip=/tmp/awq-noclip), imported "
                         "as Q4_1 and paired with its own dequantized weights")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--wiki", required=True)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--own", default="awq:q4_0,awq:q4_1,rtn:q4_0,rtn:q4_1",
                    help="edgerun's own files to make from the float model and score beside ('' for none; "
                         "AWQ is the slowest part)")
    ap.add_argument("--llama-bin", default=None, help="llama.cpp build (llama-imatrix, llama-quantize, "
                    "llama-bench): the imatrix Q4_0 row and llama.cpp's decode speed on the same files")
    ap.add_argument("--symmetric", default=None, help="a symmetric checkpoint of the same model (bench/convert_ct.py "
                    "W4A16) imported as Q4_0 for the speed table")
    ap.add_argument("--big", default=None, help="a 0.5B-class checkpoint (bench/convert_ct.py of Qwen2.5-Coder-0.5B) "
                    "whose conversion time and peak memory are measured")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speed-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "convert.json"))
    a = ap.parse_args()
    work = Path(a.work)
    src = resolve_model(a.model, pull=True)
    if not (work / "awq" / "config.json").is_file():
        sys.exit(f"{work}/awq missing: run bench/convert_autoawq.py first (see the docstring)")
    res: dict = {"machine": platform.processor() or platform.machine(), "threads": a.threads, "windows": a.windows,
                 "autoawq": json.loads((work / "autoawq.json").read_text()), "convert": {}, "ppl": {}, "pairs": {}}
    files = imports(work, "AutoAWQ", res, exact_too=True)
    ref_key = "AutoAWQ dequantized by AutoAWQ (F32)"
    also_refs = {}
    for spec in a.also:
        label, d = spec.split("=", 1)
        res.setdefault("autoawq_also", {})[label] = json.loads((Path(d) / "autoawq.json").read_text())
        got = imports(Path(d), f"AutoAWQ {label}", res, exact_too=False)
        also_refs.update({k: f"AutoAWQ {label} dequantized by AutoAWQ (F32)" for k in got})
        files.update(got)
    # the float model AutoAWQ started from, with the imports' tokenizer: every row is scored on the same tokens
    fref = dequant_reference(work / "q4_1.gguf", None, work / "float-f32.gguf", float_dir=work / "float")
    files["float (F32)"] = fref
    for method, fmt in [tuple(x.split(":")) for x in a.own.split(",") if x]:
        out = work / f"own-{method}-{fmt}.gguf"
        if not out.exists():
            r = bench_awq.run_child([sys.executable, "-c", "from edgerun.cli import main; main()", "quantize",
                                     str(fref), str(out), "--method", method, "--format", fmt, "--embed-type", "f16",
                                     "--json"])
            r.pop("stdout")
            res["convert"][f"edgerun {method} {fmt}"] = r
        files[f"edgerun {method.upper()} {fmt.upper()}"] = out
    if a.llama_bin:
        calib = work / "calib_pydoc.txt"
        calib.write_text(pydoc_text())
        out = work / "imatrix-q4_0.gguf"
        res["convert"]["llama.cpp imatrix q4_0"] = bench_awq.imatrix_quantize(Path(a.llama_bin), fref, out, "q4_0",
                                                                             calib, work, 8)
        files["llama.cpp imatrix Q4_0"] = out
    texts = bench_awq.eval_texts(a.wiki)
    scores = {}
    for k, p in files.items():
        print(f"scoring {k} ...", flush=True)
        scores[k] = bench_awq.score_texts(p, texts, a.windows, a.threads)
    for k, s in scores.items():
        res["ppl"][k] = {t: r.ppl for t, r in s.items()}
    for k in files:
        for t in texts:
            pr = res["pairs"].setdefault(k, {}).setdefault(t, {})
            pr["vs float"] = compare(scores[k][t], scores["float (F32)"][t])
            base = also_refs.get(k, ref_key if k.startswith("AutoAWQ imported") else None)
            if base:
                pr["vs AutoAWQ dequantized"] = compare(scores[k][t], scores[base][t])
    if a.big:
        from edgerun.formats.hf import SafetensorsFiles
        st = SafetensorsFiles(sorted(Path(a.big).glob("*.safetensors")))
        largest = max(e.end - e.start for e in st.index.values()) / 2**20       # as stored (the embedding)
        for kind, out in (("q4_1", work / "big-q4_1.gguf"), ("q5_0", work / "big-q5_0.gguf"), ("onnx", work / "big-onnx")):
            res["convert"][f"0.5B-class {kind}"] = edgerun_cli("convert", a.big, str(out), "--json",
                                                               *(["--exact"] if kind == "q5_0" else []),
                                                               *(["--force"] if kind == "onnx" else []))
        res["big_largest_tensor_mb"] = largest
    speed_files = {"AutoAWQ imported Q4_1": files["AutoAWQ imported Q4_1"],
                   "AutoAWQ imported Q5_0 (--exact)": files["AutoAWQ imported Q5_0 (--exact)"]}
    if a.symmetric:
        sym = work / "symmetric-q4_0.gguf"
        sym.unlink(missing_ok=True)
        res["convert"]["symmetric q4_0"] = edgerun_cli("convert", a.symmetric, str(sym), "--json")
        speed_files["compressed-tensors W4A16 imported Q4_0"] = sym
    speed_files[f"registry {src.name}"] = src
    res["speed"] = decode_speed(speed_files, a.threads, a.speed_tokens, a.rounds, a.llama_bin)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))

    def iv(v) -> str:
        return f"{v[0]:.4f} [{v[1]:.4f}, {v[2]:.4f}]"

    print("\n| file | wiki PPL | code PPL | vs float: wiki / code | vs AutoAWQ's dequantized: wiki / code |")
    print("|---|---|---|---|---|")
    for k in files:
        pr = res["pairs"][k]
        vs_f = " / ".join(iv(pr[t]["vs float"]) for t in texts)
        vs_a = " / ".join(iv(pr[t]["vs AutoAWQ dequantized"]) for t in texts) if "vs AutoAWQ dequantized" in pr["wiki"] else ""
        print(f"| {k} | {res['ppl'][k]['wiki']:.3f} | {res['ppl'][k]['code']:.3f} | {vs_f} | {vs_a} |")
    print("\n| conversion | wall s | peak RSS MB (incl. mapped checkpoint pages) | peak anonymous MB | report |")
    print("|---|---|---|---|---|")
    for k, c in res["convert"].items():
        if isinstance(c, dict) and "wall_s" in c:
            rep = c.get("report")
            summ = ""
            if isinstance(rep, dict):
                summ = ", ".join(f"{x}={rep[x]}" for x in ("storage", "exact_share", "max_rel_err")
                                 if x in rep)
            print(f"| {k} | {c['wall_s']:.1f} | {c['peak_rss_mb']:.0f} | {c.get('peak_anon_mb', 0):.0f} | {summ} |")
    print("\n| file | edgerun tok/s | llama-bench tg tok/s |")
    print("|---|---|---|")
    for k, v in res["speed"].items():
        lb = v.get("llama-bench", {}).get("tok_s")
        print(f"| {k} | {v['edgerun']['tok_s']:.1f} | {'' if lb is None else f'{lb:.1f}'} |")
    print(f"wrote {a.out} at {time.strftime('%Y-%m-%d %H:%M:%S')}")


if __name__ == "__main__":
    main()
