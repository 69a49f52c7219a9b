"""The GPU cost curve with random-weight models of the real pair's shapes (bench/gpu_curve.sh runs it).

A GPU machine lent for a few minutes has no network and takes at most 64 MiB of files: no real model
fits. A step's time depends on the tensors' shapes and storage types, not on the weights' values (the
same kernels run over the same bytes; only the logits differ), so this writes GGUFs with exactly the
Qwen2.5-Coder-1.5B and 0.5B tensors (names, shapes, ggml types: bench/gpu_shapes/*.json, read from the
registry files' headers) and random weights, and times them with edgerun's own probes:

  spec GGUF OUT.json          the header of a GGUF (a truncated file is enough): hyperparameters + tensor table
  write SPEC.json OUT.gguf    a random-weight GGUF of that table (--tiny: the same types at toy sizes)
  measure --target T --draft D --out JSON
                              T(n)/T(1), n = 1..9, logits at every position (costprobe.measure_verify_times);
                              the drafter's step (costprobe.measure_draft_step) and its own T(1); plain decode
                              tok/s; one-token vs batched logits bit for bit; the CUDA bandwidth kernel (--gpu)

Random bytes are not valid quantized blocks as they stand: each block's fp16 scale fields are set to small
finite values (so no NaN or Inf reaches the logits), the packed quants stay random.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

try:                                     # not needed to read a header (`spec` runs without numpy)
    import numpy as np
except ImportError:                      # pragma: no cover
    np = None

# ggml type ids (ggml.h) -> (name, block elements, block bytes, byte offsets of the fp16 scale fields)
GGML_TYPES = {
    0: ("F32", 1, 4, ()), 1: ("F16", 1, 2, ()), 2: ("Q4_0", 32, 18, (0,)), 3: ("Q4_1", 32, 20, (0, 2)),
    6: ("Q5_0", 32, 22, (0,)), 7: ("Q5_1", 32, 24, (0, 2)), 8: ("Q8_0", 32, 34, (0,)),
    10: ("Q2_K", 256, 84, (80, 82)), 11: ("Q3_K", 256, 110, (108,)), 12: ("Q4_K", 256, 144, (0, 2)),
    13: ("Q5_K", 256, 176, (0, 2)), 14: ("Q6_K", 256, 210, (208,)), 30: ("BF16", 1, 2, ()),
}
TYPE_IDS = {v[0]: k for k, v in GGML_TYPES.items()}


# -- reading a header ------------------------------------------------------------------------------

class _Reader:
    def __init__(self, f) -> None:
        self.f = f

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        b = self.f.read(n)
        if len(b) != n:
            raise EOFError("the file ends inside the GGUF header")
        return struct.unpack("<" + fmt, b)[0]

    def string(self) -> str:
        n = self.take("Q")
        return self.f.read(n).decode("utf-8", "replace")

    _SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            sub, n = self.take("I"), self.take("Q")
            return {"array_type": sub, "values": [self.value(sub) for _ in range(n)]}
        return self.take(self._SCALAR[vtype])


def read_spec(path: str | Path) -> dict:
    """Hyperparameters (every key but the tokenizer's token/merge lists) and the tensor table of a GGUF."""
    with open(path, "rb") as f:
        r = _Reader(f)
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = r.take("I"), r.take("Q"), r.take("Q")
        kv = {}
        for _ in range(n_kv):
            key, vtype = r.string(), r.take("I")
            val = r.value(vtype)
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                       "tokenizer.chat_template"):
                kv[key] = {"count": len(val["values"]) if isinstance(val, dict) else len(val)}
                continue
            kv[key] = {"type": vtype, "value": val}
        tensors = []
        for _ in range(n_tensors):
            name, nd = r.string(), r.take("I")
            dims = [r.take("Q") for _ in range(nd)]
            ttype, _off = r.take("I"), r.take("Q")
            tensors.append({"name": name, "ne": dims, "type": GGML_TYPES[ttype][0]})
    return {"gguf_version": version, "kv": kv, "tensors": tensors}


# -- writing a random-weight model -----------------------------------------------------------------

def _n_vocab(spec: dict) -> int:
    return int(spec["kv"]["tokenizer.ggml.tokens"]["count"])


def shrink(spec: dict, n_embd: int = 256, n_ff: int = 512, n_layer: int = 2, n_vocab: int = 1024,
           n_head: int = 4, n_head_kv: int = 2) -> dict:
    """The same tensor names and storage types at toy sizes (for a dry run on a CPU)."""
    kv = {k: dict(v) for k, v in spec["kv"].items()}
    arch = kv["general.architecture"]["value"]
    old = {"embd": kv[f"{arch}.embedding_length"]["value"], "ff": kv[f"{arch}.feed_forward_length"]["value"],
           "vocab": _n_vocab(spec)}
    old_hd = old["embd"] // kv[f"{arch}.attention.head_count"]["value"]
    old["kv"] = kv[f"{arch}.attention.head_count_kv"]["value"] * old_hd
    new = {"embd": n_embd, "ff": n_ff, "vocab": n_vocab, "kv": n_head_kv * (n_embd // n_head)}
    dim_map = {old[k]: new[k] for k in old}
    for key, v in ((f"{arch}.embedding_length", n_embd), (f"{arch}.feed_forward_length", n_ff),
                   (f"{arch}.block_count", n_layer), (f"{arch}.attention.head_count", n_head),
                   (f"{arch}.attention.head_count_kv", n_head_kv)):
        kv[key]["value"] = v
    kv["tokenizer.ggml.tokens"] = {"count": n_vocab}
    tensors = []
    for t in spec["tensors"]:
        if t["name"].startswith("blk.") and int(t["name"].split(".")[1]) >= n_layer:
            continue
        tensors.append({**t, "ne": [dim_map.get(d, d) for d in t["ne"]]})
    return {**spec, "kv": kv, "tensors": tensors}


def synthetic_vocab(n: int) -> tuple[list[str], list[int], list[str]]:
    """n tokens: GPT-2's 256 byte tokens, one merge, numbered fillers, three control tokens (a real tokenizer
    is not needed: the probes feed token ids; every text still tokenizes, byte by byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    b2u, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in b2u:
            b2u[b] = chr(256 + extra)
            extra += 1
    tokens = [b2u[b] for b in range(256)] + ["Ġt"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [f"<filler{i}>" for i in range(n - len(tokens) - len(specials))]
    types = [1] * len(tokens) + [3] * len(specials)
    return tokens + specials, types, ["Ġ t"]


def random_tensor(t: dict, rng):
    """Random data for one tensor: floats N(0, 0.02) (norms 1 + small noise), quantized blocks of random
    bytes with finite fp16 scales."""
    name, blk, bsize, scale_offs = GGML_TYPES[TYPE_IDS[t["type"]]]
    n = int(np.prod(t["ne"]))
    if name == "F32":
        base = 1.0 if t["name"].endswith("norm.weight") else 0.0
        return (base + rng.normal(0, 0.02, n)).astype(np.float32).reshape(t["ne"][::-1])
    if name in ("F16", "BF16"):
        a = rng.normal(0, 0.02, n).astype(np.float32)
        if name == "F16":
            return a.astype(np.float16).reshape(t["ne"][::-1])
        return (a.view(np.uint32) >> 16).astype(np.uint16).reshape(t["ne"][::-1])
    n_blocks = n // blk
    raw = rng.integers(0, 256, size=(n_blocks, bsize), dtype=np.uint8)
    for off in scale_offs:        # fp16 scales in [0.5e-3, 2e-3]: finite, small
        raw[:, off:off + 2] = rng.uniform(0.5e-3, 2e-3, n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if name == "Q6_K":            # its int8 sub-scales: small positive (random int8 could overflow nothing, but keep tame)
        raw[:, 192:208] = rng.integers(1, 16, size=(n_blocks, 16), dtype=np.uint8)
    return raw.reshape(-1)


def write_model(spec: dict, out: str | Path, seed: int = 0) -> Path:
    """A GGUF with spec's hyperparameters and tensor table, random weights, a synthetic vocabulary; written
    with edgerun's GGUF writer (edgerun/formats/gguf.py: atomic, streamed tensor by tensor)."""
    import gguf

    from edgerun.formats.gguf import KV, TensorPlan, write_gguf

    V = gguf.GGUFValueType
    kv = spec["kv"]
    arch = kv["general.architecture"]["value"]
    tokens, types, merges = synthetic_vocab(_n_vocab(spec))
    kvs = []
    for key, v in kv.items():
        if key.startswith(("tokenizer.", "general.architecture", "general.file_type",
                           "general.quantization_version", "GGUF.")) or "type" not in v:
            continue
        if v["type"] == 9:
            kvs.append(KV(key, v["value"]["values"], V.ARRAY, V(v["value"]["array_type"])))
        else:
            kvs.append(KV(key, v["value"], V(v["type"])))
    n = len(tokens)
    kvs += [KV("tokenizer.ggml.model", "gpt2", V.STRING), KV("tokenizer.ggml.pre", "qwen2", V.STRING),
            KV("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
            KV("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32),
            KV("tokenizer.ggml.merges", merges, V.ARRAY, V.STRING),
            KV("tokenizer.ggml.bos_token_id", n - 3, V.UINT32), KV("tokenizer.ggml.eos_token_id", n - 1, V.UINT32),
            KV("tokenizer.ggml.padding_token_id", n - 3, V.UINT32), KV("tokenizer.ggml.add_bos_token", False, V.BOOL)]
    plan = [TensorPlan(t["name"], tuple(t["ne"][::-1]), gguf.GGMLQuantizationType[t["type"]]) for t in spec["tensors"]]
    rng = np.random.default_rng(seed)
    ftype = kv.get("general.file_type", {}).get("value")
    return write_gguf(out, arch, kvs, plan, (random_tensor(t, rng) for t in spec["tensors"]), file_type=ftype)


# -- measuring -------------------------------------------------------------------------------------

def _backend(path: str, n_gpu_layers: int, threads: int, flash_attn: bool = True):
    from edgerun.backends.llamacpp import LlamaCppBackend
    from edgerun.config import BackendArgs

    return LlamaCppBackend(path, BackendArgs(n_ctx=512, n_batch=512, n_threads=threads, n_gpu_layers=n_gpu_layers,
                                            flash_attn=flash_attn))


def bit_equality(backend, n_max: int = 9, context: int = 32) -> dict:
    """Logits of positions evaluated one token per call vs all in one call, after the same context:
    {n: (equal bit for bit, max |difference|)}. Greedy speculative output equals plain greedy only where
    they are equal (docs/speculative.md)."""
    rng = np.random.default_rng(1)
    seq = [int(x) for x in rng.integers(300, backend.n_vocab - 3, size=context + n_max)]
    backend.truncate(0)
    backend.eval(seq[:context], n_logits=0)
    one = np.stack([backend.eval([seq[context + i]])[-1] for i in range(n_max)])
    out = {}
    for n in range(2, n_max + 1):
        backend.truncate(context)
        batched = backend.eval(seq[context:context + n])
        d = np.abs(batched.astype(np.float64) - one[:n].astype(np.float64))
        out[n] = {"equal": bool(np.array_equal(batched, one[:n])), "max_abs_diff": float(np.nanmax(d)),
                  "finite": bool(np.isfinite(batched).all())}
    backend.truncate(0)
    return out


def plain_decode_tps(backend, n_tokens: int = 64, context: int = 32, reps: int = 3) -> float:
    """Tokens/s of one-token steps (the plain decode loop's target calls), best of reps."""
    best = 0.0
    for _ in range(reps):
        backend.truncate(0)
        backend.eval(list(range(300, 300 + context)), n_logits=0)
        tok = 400
        t0 = time.perf_counter()
        for i in range(n_tokens):
            row = backend.eval([tok])[-1]
            tok = int(np.argmax(row)) if np.isfinite(row).all() else 400 + i
        best = max(best, n_tokens / (time.perf_counter() - t0))
    backend.truncate(0)
    return best


def measure(args) -> dict:
    from edgerun import llama_lib
    from edgerun.config import BackendArgs, SpeculativeArgs
    from edgerun.device.costprobe import measure_draft_step, measure_verify_times
    from edgerun.speculative.drafters import make_drafter

    res: dict = {"note": "random weights with the real pair's tensor shapes and storage types: step times depend on "
                         "those, not on the values", "n_gpu_layers": args.n_gpu_layers,
                 "devices": [list(d) for d in llama_lib.devices()], "threads": args.threads}
    target = _backend(args.target, args.n_gpu_layers, args.threads)
    res["target"] = {"file": Path(args.target).name, "bytes": Path(args.target).stat().st_size,
                     "placement": target.placement.to_dict() if target.placement else None}
    times = measure_verify_times(target, n_max=args.n_max, reps=args.reps)
    tv = times.min(axis=0)
    res["t_verify_s"] = [float(x) for x in tv]
    res["ratios"] = [float(x / tv[0]) for x in tv]
    res["unsteady"] = bool((times.max(axis=0) > 1.5 * times.min(axis=0)).any())
    res["plain_decode_tps_target"] = plain_decode_tps(target)
    res["bit_equality_target"] = {str(k): v for k, v in bit_equality(target, args.n_max).items()}
    if args.draft:
        dback = _backend(args.draft, args.n_gpu_layers, args.threads)
        dt = measure_verify_times(dback, n_max=2, reps=args.reps).min(axis=0)
        res["draft"] = {"file": Path(args.draft).name, "bytes": Path(args.draft).stat().st_size,
                        "placement": dback.placement.to_dict() if dback.placement else None,
                        "t1_s": float(dt[0]), "plain_decode_tps": plain_decode_tps(dback)}
        res["bit_equality_draft"] = {str(k): v for k, v in bit_equality(dback, args.n_max).items()}
        dback.close()
        drafter = make_drafter(args.draft, target, backend_args=BackendArgs(
            n_ctx=512, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers, flash_attn=True),
            spec_args=SpeculativeArgs(gamma=4), pull=False)
        res["t_draft_step_s"] = measure_draft_step(drafter, target, gamma=4)
        res["draft_step_over_target_t1"] = res["t_draft_step_s"] / res["t_verify_s"][0]
        res["draft_t1_over_target_t1"] = res["draft"]["t1_s"] / res["t_verify_s"][0]
        drafter.close()
    target.close()
    if args.gpu:
        from edgerun.device.bandwidth import probe_bandwidth

        bw = probe_bandwidth(method="cuda", array_bytes=1 << 30, reps=10)
        res["bandwidth_cuda"] = bw.to_dict()
        if args.rated_gbs:
            res["bandwidth_cuda"]["rated_gbs"] = args.rated_gbs
            res["bandwidth_cuda"]["of_rated"] = bw.best_gbs / args.rated_gbs
    return res


def print_table(res: dict) -> None:
    r = res["ratios"]
    print("| n | " + " | ".join(str(i + 1) for i in range(len(r))) + " |")
    print("|---" * (len(r) + 1) + "|")
    print("| T(n)/T(1) | " + " | ".join(f"{x:.2f}" for x in r) + " |")
    print(f"T(1) {res['t_verify_s'][0] * 1e3:.2f} ms; plain decode (target) {res['plain_decode_tps_target']:.1f} tok/s")
    if "draft" in res:
        print(f"drafter step / target T(1): {res['draft_step_over_target_t1']:.2f} (its own T(1): "
              f"{res['draft_t1_over_target_t1']:.2f}); drafter plain {res['draft']['plain_decode_tps']:.1f} tok/s")
    eq = res["bit_equality_target"]
    print("one-token == batched logits (target), n=2..: " +
          " ".join(f"{n}:{'=' if v['equal'] else '%.2g' % v['max_abs_diff']}" for n, v in eq.items()))
    if "bandwidth_cuda" in res:
        b = res["bandwidth_cuda"]
        print(f"CUDA bandwidth kernel: copy {b['copy_gbs']:.0f} GB/s, triad {b['triad_gbs']:.0f} GB/s"
              + (f" ({b['of_rated']:.0%} of rated {b['rated_gbs']:.0f})" if "of_rated" in b else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("spec")
    s.add_argument("gguf")
    s.add_argument("out")
    w = sub.add_parser("write")
    w.add_argument("spec")
    w.add_argument("out")
    w.add_argument("--tiny", action="store_true", help="same names and types at toy sizes (a CPU dry run)")
    w.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("measure")
    m.add_argument("--target", required=True)
    m.add_argument("--draft")
    m.add_argument("--out", required=True)
    m.add_argument("--n-gpu-layers", type=int, default=-1)
    m.add_argument("--threads", type=int, default=4)
    m.add_argument("--n-max", type=int, default=9)
    m.add_argument("--reps", type=int, default=5)
    m.add_argument("--gpu", action="store_true", help="also run the CUDA bandwidth kernel")
    m.add_argument("--rated-gbs", type=float, default=None, help="the card's rated memory bandwidth, GB/s")
    a = ap.parse_args(argv)
    if a.cmd == "spec":
        Path(a.out).write_text(json.dumps(read_spec(a.gguf), indent=1) + "\n")
    elif a.cmd == "write":
        spec = json.loads(Path(a.spec).read_text())
        write_model(shrink(spec) if a.tiny else spec, a.out, a.seed)
        print(f"wrote {a.out} ({Path(a.out).stat().st_size / 1e6:.1f} MB)")
    else:
        res = measure(a)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        print_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
