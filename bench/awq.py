"""AWQ vs round-to-nearest vs llama.cpp's importance matrix: perplexity, wall time, peak memory.

For each model, the FLOAT REFERENCE is the registry model dequantized (no package ships float
weights; DATA.md): its tensors are written as an F32 GGUF and every quantization starts from it.

    python bench/awq.py --wiki /path/enwiki_sample.txt [--models smollm2-135m-instruct ...]
                        [--windows 16] [--peer-bin DIR] [--work /tmp/edgerun-bench-awq]

Texts (perplexity at ctx 512, scored like llama-perplexity: second half of each window):
  wiki  the English Wikipedia sample of DATA.md (gensim's test data, extracted with extract_pages +
        filter_wiki, redirects and pages under 500 characters dropped), first --windows windows;
  code  CPython stdlib source, a held-out slice (characters 6,000,000 onward of the sorted files,
        disjoint from the calibration slice, which is the first 4,000,000 characters).
Calibration: 'builtin' (Python reference prose, the default) and 'stdlib-code'; 4096 tokens.
Cross-domain: AWQ calibrated on code evaluated on prose (wiki), and calibrated on prose evaluated on code.
Peer: llama-imatrix + llama-quantize (built from the llama-cpp-python sdist; --peer-bin) on the same
F32 reference with the same calibration text, token embeddings and output as Q8_0 like ours: both
llama.cpp's file type as it ships (for Q4_0 with an imatrix, llama.cpp stores the first n_layer/8
ffn_down tensors as Q4_1) and, for Q4_0, `--pure` (every linear Q4_0: exactly edgerun's tensor types).

Writes bench/results/awq.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgerun.eval.texts import pydoc_text, stdlib_code_text# noqa: E402
from edgerun.formats.gguf import GGUFSource, TensorPlan, source_kv, write_gguf# noqa: E402
from edgerun.eval.perplexity import paired_ratio, perplexity# noqa: E402
from edgerun.resolve import resolve_model# noqa: E402


def float_reference(src_path: Path, out: Path) -> Path:
    """The dequantized model as an F32 GGUF (the float reference)."""
    import gguf
    if out.exists():
        return out
    src = GGUFSource(src_path)
    plan = [TensorPlan(n, tuple(int(x) for x in reversed(src._tensors[n].shape)), gguf.GGMLQuantizationType.F32)
            for n in src.tensor_names()]
    write_gguf(out, src.cfg.arch, source_kv(src), plan, (src.tensor(n) for n in src.tensor_names()), 0)
    return out


def eval_texts(wiki: str) -> dict[str, str]:
    """The two evaluation texts: the Wikipedia sample at `wiki`, and the held-out stdlib code slice."""
    return {"wiki": Path(wiki).read_text(), "code": stdlib_code_text(6_400_000)[6_000_000:]}


def score_texts(path: Path, texts: dict[str, str], windows: int, threads: int) -> dict:
    """{text name: PerplexityResult} of the GGUF at `path` on each text (ctx 512, first `windows` windows)."""
    return {t: perplexity(path, text, ctx=512, n_threads=threads, max_windows=windows, text_name=t)
            for t, text in texts.items()}


def run_child(cmd: list[str]) -> dict:
    """Run a command; return wall seconds, CPU seconds and peak RSS (MB) of that child."""
    # this child's own rusage (wait4): RUSAGE_CHILDREN's ru_maxrss is the largest of all children so far
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        anon = [0, 0]

        # peak anonymous memory and peak RSS, sampled: a child's ru_maxrss starts from the parent's RSS at fork
        def sample() -> None:
            while p.returncode is None:
                try:
                    with open(f"/proc/{p.pid}/status") as f:
                        kb = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith("Rss")}
                    anon[0] = max(anon[0], kb.get("RssAnon", 0))
                    anon[1] = max(anon[1], kb.get("RssAnon", 0) + kb.get("RssFile", 0))
                except (OSError, ValueError):
                    return
                time.sleep(0.02)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        sampler.join()
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{stderr[-3000:]}")
    return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_mb": anon[1] / 1024,
            "peak_anon_mb": anon[0] / 1024, "stdout": stdout}


def quantize(src: Path, out: Path, method: str, fmt: str, calib: str) -> dict:
    if out.exists():
        return {"cached": True}
    r = run_child([sys.executable, "-c", "from edgerun.cli import main; main()", "quantize", str(src), str(out), "--method", method,
                   "--format", fmt, "--calib", calib, "--json"])
    rep = json.loads(r.pop("stdout"))
    r.update(error_reduction=rep["error_reduction"], choices={c: sum(g["choice"] == c for g in rep["groups"])
                                                              for c in ("awq", "clip", "rtn")})
    return r


def imatrix_quantize(bin_dir: Path, ref: Path, out: Path, fmt: str, calib_file: Path, work: Path,
                     n_chunks: int, pure: bool = False) -> dict:
    """llama-imatrix on the calibration text, then llama-quantize with it.

    pure: every linear in `fmt` (--pure), the same tensor types as edgerun writes; otherwise
    llama.cpp's own mix for the file type (for Q4_0 with an imatrix it stores the first n_layer/8
    ffn_down tensors as Q4_1).
    """
    imat = work / f"{ref.stem}.imatrix.gguf"
    info = {}
    if not imat.exists():
        info["imatrix"] = run_child([str(bin_dir / "llama-imatrix"), "-m", str(ref), "-f", str(calib_file),
                                     "-o", str(imat), "-c", "512", "--chunks", str(n_chunks), "-t", "2"])
        info["imatrix"].pop("stdout")
    if not out.exists():
        info["quantize"] = run_child([str(bin_dir / "llama-quantize"), "--imatrix", str(imat),
                                      *(["--pure"] if pure else []),
                                      "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0",
                                      str(ref), str(out), fmt.upper(), "2"])
        info["quantize"].pop("stdout")
    return info


def paired_table(v: dict, formats: list[str], texts) -> list[dict]:
    """AWQ against RTN and each imatrix peer, per format and text: paired PPL ratios with 95% intervals."""
    rows = []
    for fmt in formats:
        for b in (f"rtn_{fmt}", f"imatrix_{fmt}", f"imatrix_pure_{fmt}"):
            for t in texts:
                va, vb = v.get(f"awq_{fmt}", {}), v.get(b, {})
                if f"window_nll_{t}" in va and f"window_nll_{t}" in vb:
                    r, lo, hi = paired_ratio(va[f"window_nll_{t}"], vb[f"window_nll_{t}"])
                    rows.append({"a": f"awq_{fmt}", "b": b, "text": t, "ratio": r, "lo": lo, "hi": hi})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
    ap.add_argument("--wiki", required=True, help="the extracted Wikipedia sample (see the module docstring)")
    ap.add_argument("--windows", type=int, default=16, help="ctx-512 windows scored per text")
    ap.add_argument("--formats", nargs="+", default=["q4_0", "q4_1"])
    ap.add_argument("--cross-formats", nargs="*", default=["q4_0"], help="formats also calibrated on code")
    ap.add_argument("--peer-bin", default=None, help="directory with llama-imatrix and llama-quantize")
    ap.add_argument("--work", default="/tmp/edgerun-bench-awq")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "awq.json"))
    a = ap.parse_args()

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    texts = eval_texts(a.wiki)
    calib_file = work / "calib_pydoc.txt"
    calib_file.write_text(pydoc_text())
    results = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "load_avg_start": os.getloadavg()},
               "method": {"float_reference": "registry model dequantized with gguf.quants, stored F32",
                          "ppl": "ctx 512, non-overlapping windows, second half scored (llama-perplexity)",
                          "windows": a.windows, "calib_tokens": 4096,
                          "texts": {"wiki": "enwiki sample (gensim test data, DATA.md)",
                                    "code": "CPython stdlib source chars 6.0M-6.4M (held out)"}},
               "models": {}}
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    for name in a.models:
        src = resolve_model(name)
        ref = float_reference(src, work / f"{name}.f32.gguf")
        variants = {"float": (ref, {})}
        for fmt in a.formats:
            variants[f"rtn_{fmt}"] = (work / f"{name}.rtn_{fmt}.gguf", None)
            variants[f"awq_{fmt}"] = (work / f"{name}.awq_{fmt}.gguf", None)
        for fmt in a.cross_formats:
            variants[f"awq_{fmt}_code"] = (work / f"{name}.awq_{fmt}_code.gguf", None)
        m = results["models"].setdefault(name, {"variants": {}})
        for key, (path, info) in variants.items():
            if info is None:
                method, fmt = key.split("_")[0], "_".join(key.split("_")[1:3])
                calib = "stdlib-code" if key.endswith("_code") else "builtin"
                print(f"[{name}] quantize {key} ...", flush=True)
                info = quantize(ref, path, method, fmt, calib)
            m["variants"][key] = {"quant": info}
        if a.peer_bin:
            peers = [(f"imatrix_{fmt}", fmt, False) for fmt in a.formats]
            peers += [(f"imatrix_pure_{fmt}", fmt, True) for fmt in a.formats if fmt == "q4_0"]
            for key, fmt, pure in peers:
                path = work / f"{name}.{key}.gguf"
                print(f"[{name}] llama-imatrix + llama-quantize {fmt}{' --pure' if pure else ''} ...", flush=True)
                try:
                    info = imatrix_quantize(Path(a.peer_bin), ref, path, fmt, calib_file, work, 8, pure)
                    variants[key] = (path, info)
                    m["variants"][key] = {"quant": info}
                except (RuntimeError, FileNotFoundError) as e:
                    m["variants"][key] = {"error": str(e)[-500:]}
        for key, (path, _) in variants.items():
            for tname, text in texts.items():
                print(f"[{name}] ppl {key} on {tname} ...", flush=True)
                r = perplexity(path, text, ctx=512, n_threads=a.threads, max_windows=a.windows, text_name=tname)
                m["variants"][key][f"ppl_{tname}"] = r.ppl
                m["variants"][key][f"nll_se_{tname}"] = r.nll_stderr
                m["variants"][key][f"window_nll_{tname}"] = list(r.window_nll)
            json.dump(results, open(out_path, "w"), indent=1)
        # derived: share of RTN's perplexity increase removed by AWQ, and what cross-domain calibration keeps
        v = m["variants"]
        for fmt in a.formats:
            for t in texts:
                f, r_, q = v["float"][f"ppl_{t}"], v[f"rtn_{fmt}"][f"ppl_{t}"], v[f"awq_{fmt}"][f"ppl_{t}"]
                m[f"awq_gain_{fmt}_{t}"] = (r_ - q) / (r_ - f) if r_ != f else None
        for fmt in a.cross_formats:
            for t, in_dom, cross in (("wiki", f"awq_{fmt}", f"awq_{fmt}_code"), ("code", f"awq_{fmt}_code", f"awq_{fmt}")):
                f, r_ = v["float"][f"ppl_{t}"], v[f"rtn_{fmt}"][f"ppl_{t}"]
                g_in = (r_ - v[in_dom][f"ppl_{t}"]) / (r_ - f)
                g_x = (r_ - v[cross][f"ppl_{t}"]) / (r_ - f)
                m[f"cross_{fmt}_{t}"] = {"gain_in_domain": g_in, "gain_cross_domain": g_x,
                                         "gain_lost_fraction": (g_in - g_x) / g_in if g_in else None}
        m["paired"] = paired_table(v, a.formats, texts)
        json.dump(results, open(out_path, "w"), indent=1)
    results["machine"]["load_avg_end"] = os.getloadavg()
    json.dump(results, open(out_path, "w"), indent=1)

    print(f"\nperplexity, ctx 512, {a.windows} windows per text; float = dequantized registry model")
    print(f"{'model':30s} {'variant':18s} {'wiki':>9s} {'code':>9s} {'quant s':>8s} {'cpu s':>8s} {'peak MB':>8s}")
    for name, m in results["models"].items():
        for key, v in m["variants"].items():
            q = v.get("quant", {})
            if "quantize" in q:
                q = {"wall_s": q["quantize"]["wall_s"] + q.get("imatrix", {}).get("wall_s", 0),
                     "cpu_s": q["quantize"]["cpu_s"] + q.get("imatrix", {}).get("cpu_s", 0),
                     "peak_rss_mb": max(q["quantize"]["peak_rss_mb"], q.get("imatrix", {}).get("peak_rss_mb", 0))}
            fmt = lambda x: f"{x:9.3f}" if isinstance(x, float) else f"{'-':>9s}"  # noqa: E731
            tm = lambda k: f"{q[k]:8.0f}" if k in q else f"{'-':>8s}"  # noqa: E731
            print(f"{name:30s} {key:18s} {fmt(v.get('ppl_wiki'))} {fmt(v.get('ppl_code'))} "
                  f"{tm('wall_s')} {tm('cpu_s')} {tm('peak_rss_mb')}")
        for k, val in m.items():
            if k.startswith("awq_gain"):
                print(f"  {k}: {val:.1%}" if val is not None else f"  {k}: -")
            elif k == "paired":
                for row in val:
                    print(f"  {row['a']} / {row['b']} on {row['text']}: PPL x{row['ratio']:.4f} "
                          f"(95% {row['lo']:.4f} .. {row['hi']:.4f}, paired over windows)")
            elif k.startswith("cross_"):
                print(f"  {k}: in-domain gain {val['gain_in_domain']:.1%}, cross-domain {val['gain_cross_domain']:.1%}, "
                      f"lost {val['gain_lost_fraction']:.1%}" if val["gain_lost_fraction"] is not None else f"  {k}: -")
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
