"""The figures of emulate_pi.sh's bundle stage: results/bundle.json and a small table.

The bundle's wall time was measured on this x86-64 host; the install's, the service's start and the chat
completion's ran under qemu-user, so they are emulated times (they say nothing of a board's speed); no
tokens per second are reported.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def tree(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    return sum(p.stat().st_size for p in files), len(files)


def main() -> None:
    ap = argparse.ArgumentParser()
    for a in ("--bundle", "--results", "--profile", "--model", "--python", "--qemu-cpu", "--llama-wheel"):
        ap.add_argument(a, required=True)
    a = ap.parse_args()
    out, res = Path(a.bundle), Path(a.results)
    total, n = tree(out)
    wheels, nw = tree(out / "wheels")
    models, nm = tree(out / "models")
    t0, t1, t2 = map(float, (res / "bundle.serve.times").read_text().split())
    chat = json.loads((res / "bundle.chat.json").read_text())
    answer = chat["choices"][0]["message"]["content"]
    health = json.loads((res / "bundle.health.json").read_text())
    d = {
        "profile": a.profile, "model": a.model, "python": a.python, "llama_wheel": a.llama_wheel,
        "emulated_cpu": a.qemu_cpu,
        "bundle_seconds": float((res / "bundle.time").read_text().split()[-1]),
        "bundle_bytes": total, "bundle_files": n, "wheels_bytes": wheels, "wheels_files": nw,
        "models_bytes": models, "models_files": nm,
        "install_seconds_emulated": float((res / "bundle.install.time").read_text().split()[-1]),
        "service_ready_seconds_emulated": round(t1 - t0, 1),
        "chat_seconds_emulated": round(t2 - t1, 1),
        "health": {k: health.get(k) for k in ("status", "model")},
        "answer": answer, "finish_reason": chat["choices"][0].get("finish_reason"), "usage": chat.get("usage"),
    }
    (res / "bundle.json").write_text(json.dumps(d, indent=2) + "\n")
    rows = [
        ("bundle (made here, x86-64)", f"{d['bundle_seconds']:.1f} s"),
        ("bundle size", f"{total / 1e6:.1f} MB in {n} files (wheels/ {wheels / 1e6:.1f} MB in {nw}, "
                        f"models/ {models / 1e6:.1f} MB in {nm})"),
        (f"install.sh in unshare -n (emulated {a.qemu_cpu})", f"{d['install_seconds_emulated']:.1f} s"),
        ("ExecStart to /health ok (emulated)", f"{d['service_ready_seconds_emulated']:.1f} s"),
        ("one chat completion (emulated)", f"{d['chat_seconds_emulated']:.1f} s"),
        ("answer", repr(answer)),
    ]
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print(f"(written to {res / 'bundle.json'})")
    if not answer.strip():
        sys.exit("the chat completion's answer is empty")


if __name__ == "__main__":
    main()
