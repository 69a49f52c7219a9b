"""Correctness checks of a cross-built ARM llama.cpp under emulation, against the x86 build and the
exact numpy forward. Run by bench/boards/emulate_pi.sh: `logits` and `kernel` run inside the emulated
arm64 root filesystem (and `logits` also on the host, for the x86 build); `reference` and `compare`
run on the host. Nothing here measures speed: emulated time says nothing about a board.

    python pi_checks.py logits --model M --positions 300 --threads 2 --label rpi5-8gb --out F.npz
    python pi_checks.py reference --model M --tokens-from F.npz --out R.npz
    python pi_checks.py compare --x86 X.npz --reference R.npz --arm rpi5-8gb=F.npz [--arm ...] --out C.json
    python pi_checks.py kernel --lib libstream.so
"""

from __future__ import annotations

import argparse
import json
import platform
import struct
import sys
from pathlib import Path

import numpy as np

ELF_MACHINES = {0x3E: "x86-64", 0xB7: "aarch64"}


def elf_machine(path: Path) -> str:
    """The e_machine of an ELF file (what the shared library was compiled for)."""
    head = Path(path).read_bytes()[:20]
    if head[:4] != b"\x7fELF":
        raise SystemExit(f"{path} is not an ELF file")
    (machine,) = struct.unpack_from("<H", head, 18)
    return ELF_MACHINES.get(machine, hex(machine))


def build_info() -> dict:
    """Which llama.cpp this process loaded: its library files' architecture and ggml's CPU features."""
    import llama_cpp
    from llama_cpp import llama_cpp as C

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    libs = {p.name: elf_machine(p) for p in sorted(lib_dir.glob("lib*.so")) if not p.is_symlink()}
    return {"machine": platform.machine(), "llama_cpp_python": llama_cpp.__version__,
            "system_info": C.llama_print_system_info().decode().strip(), "libs": libs}


def cmd_logits(a) -> None:
    from edgerun.backends.llamacpp import LlamaCppBackend
    from edgerun.config import BackendArgs
    from edgerun.eval.texts import pydoc_text

    info = build_info()
    be = LlamaCppBackend(a.model, BackendArgs(n_ctx=1024, n_threads=a.threads, n_batch=512, flash_attn=True))
    toks = be.tokenizer.tokenize(pydoc_text()[:8000], special=False)[: a.positions]   # the start of the prose
    logits = be.eval(toks)                                            # [positions, V] float32
    be.close()
    np.savez(a.out, tokens=np.asarray(toks, np.int64), logits=logits.astype(np.float32),
             info=json.dumps({**info, "label": a.label, "threads": a.threads}))
    print(json.dumps({"label": a.label, "positions": len(toks), **info}, indent=1))


def cmd_reference(a) -> None:
    from edgerun.reference.llama import ReferenceModel

    toks = np.load(a.tokens_from)["tokens"]
    ref = ReferenceModel.from_gguf(a.model, dtype=np.float64)
    logits = ref.forward(toks.tolist())
    np.savez(a.out, tokens=toks, logits=logits.astype(np.float64))
    print(f"exact numpy forward (float64) over {len(toks)} positions -> {a.out}")


def cmd_compare(a) -> None:
    from edgerun.eval.agreement import top1_agreement

    runs = {"x86": np.load(a.x86)}
    for spec in a.arm:
        label, _, path = spec.partition("=")
        runs[label] = np.load(path)
    ref = np.load(a.reference)
    for label, r in runs.items():
        if not np.array_equal(r["tokens"], ref["tokens"]):
            raise SystemExit(f"{label}: its tokens differ from the reference's: not the same text")
    out = {"positions": int(len(ref["tokens"])), "builds": {k: json.loads(str(v["info"])) for k, v in runs.items()}}
    base = top1_agreement(runs["x86"]["logits"], ref["logits"])
    out["x86_vs_exact"] = base
    ok = True
    for label in runs:
        if label == "x86":
            continue
        vs_x86 = top1_agreement(runs[label]["logits"], runs["x86"]["logits"])
        vs_ref = top1_agreement(runs[label]["logits"], ref["logits"])
        passed = vs_ref["top1_agreement"] >= base["top1_agreement"] - 0.01
        ok &= passed
        out[label] = {"vs_x86": vs_x86, "vs_exact": vs_ref, "passes": passed}
    out["passes"] = ok
    Path(a.out).write_text(json.dumps(out, indent=1))
    n = out["positions"]
    print(f"teacher-forced top-1 agreement over {n} positions of the Python reference prose")
    print(f"{'build':12s} {'vs x86':>8s} {'vs exact':>9s} {'max|dlogit| vs x86':>19s}  check (>= x86 vs exact - 0.01)")
    print(f"{'x86':12s} {'-':>8s} {base['top1_agreement']:9.4f} {'-':>19s}")
    for label in runs:
        if label != "x86":
            r = out[label]
            print(f"{label:12s} {r['vs_x86']['top1_agreement']:8.4f} {r['vs_exact']['top1_agreement']:9.4f} "
                  f"{r['vs_x86']['max_abs_diff']:19.4f}  {'pass' if r['passes'] else 'FAIL'}")
    sys.exit(0 if ok else 1)


def cmd_kernel(a) -> None:
    from edgerun.device import bandwidth, kernels

    lib = Path(a.lib).resolve()
    kernels.build_stream_c = lambda: lib          # the cross-built library instead of a build here
    n = a.mib * 2**20 // 8
    bandwidth.c_stream(n, a.threads, 2)           # raises unless the kernel ran and its checksum is right
    copy = bandwidth.numpy_stream(n, 1, 1)        # the numpy fallback runs too (its own checks)
    print(json.dumps({"lib": str(lib), "lib_machine": elf_machine(lib), "machine": platform.machine(),
                      "doubles": n, "threads": a.threads, "checksum": "ok", "numpy_fallback": "ok" if copy else "-"}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("logits")
    p.add_argument("--model", required=True)
    p.add_argument("--positions", type=int, default=300)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--label", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("reference")
    p.add_argument("--model", required=True)
    p.add_argument("--tokens-from", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("compare")
    p.add_argument("--x86", required=True)
    p.add_argument("--reference", required=True)
    p.add_argument("--arm", action="append", default=[], help="LABEL=FILE.npz (repeatable)")
    p.add_argument("--out", required=True)
    p = sub.add_parser("kernel")
    p.add_argument("--lib", required=True)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    {"logits": cmd_logits, "reference": cmd_reference, "compare": cmd_compare, "kernel": cmd_kernel}[a.cmd](a)


if __name__ == "__main__":
    main()
