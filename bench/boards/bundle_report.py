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
    starts = []
    for i in (1, 2):      # the first start (hashes the model, probes the costs) and the second (cached)
        t0, t1, t2 = map(float, (res / f"bundle.serve{i}.times").read_text().split())
        chat = json.loads((res / f"bundle.chat{i}.json").read_text())
        health = json.loads((res / f"bundle.health{i}.json").read_text())
        starts.append({"ready_seconds_emulated": round(t1 - t0, 1), "chat_seconds_emulated": round(t2 - t1, 1),
                       "health": {k: health.get(k) for k in ("status", "model")},
                       "backends": (health.get("gpu") or {}).get("backends"),
                       "answer": chat["choices"][0]["message"]["content"],
                       "finish_reason": chat["choices"][0].get("finish_reason"), "usage": chat.get("usage")})
    d = {
        "profile": a.profile, "model": a.model, "python": a.python, "llama_wheel": a.llama_wheel,
        "emulated_cpu": a.qemu_cpu,
        "bundle_seconds": float((res / "bundle.time").read_text().split()[-1]),
        "bundle_bytes": total, "bundle_files": n, "wheels_bytes": wheels, "wheels_files": nw,
        "models_bytes": models, "models_files": nm,
        "install_seconds_emulated": float((res / "bundle.install.time").read_text().split()[-1]),
        "first_start": starts[0], "second_start": starts[1],
    }
    (res / "bundle.json").write_text(json.dumps(d, indent=2) + "\n")
    rows = [
        ("bundle (made here, x86-64)", f"{d['bundle_seconds']:.1f} s"),
        ("bundle size", f"{total / 1e6:.1f} MB in {n} files (wheels/ {wheels / 1e6:.1f} MB in {nw}, "
                        f"models/ {models / 1e6:.1f} MB in {nm})"),
        (f"install.sh in unshare -n (emulated {a.qemu_cpu})", f"{d['install_seconds_emulated']:.1f} s"),
    ]
    for name, st in (("first", starts[0]), ("second", starts[1])):
        rows += [(f"{name} start: ExecStart to /health ok (emulated)", f"{st['ready_seconds_emulated']:.1f} s"),
                 (f"{name} start: one chat completion (emulated)",
                  f"{st['chat_seconds_emulated']:.1f} s: {st['answer']!r}")]
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print(f"(written to {res / 'bundle.json'})")
    if not all(st["answer"].strip() for st in starts):
        sys.exit("a chat completion's answer is empty")


if __name__ == "__main__":
    main()
