"""`edgerun worker` and `edgerun cluster status`: a model split over several boards."""

from __future__ import annotations

import json

import click

from ..cluster.rpc import parse_endpoints
from ..cluster.status import format_table, require_all, status
from ..cluster.worker import check_host, NETWORK_WARNING, serve as run_worker, WorkerConfig


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, envvar="EDGERUN_WORKER_HOST", show_envvar=True,
              help="Address to listen on. ggml-rpc has no authentication: keep loopback and let the head come in "
                   "through an SSH tunnel. Another address needs --allow-network; 0.0.0.0 is refused.")
@click.option("--port", type=click.IntRange(1, 65535), default=50052, show_default=True, envvar="EDGERUN_WORKER_PORT",
              show_envvar=True, help="TCP port.")
@click.option("--threads", type=click.IntRange(1, None), default=None, envvar="EDGERUN_WORKER_THREADS",
              show_envvar=True, help="CPU threads for the layers computed here (default: "
              "physical cores).")
@click.option("--device", "devices", default=None, metavar="NAME,...", envvar="EDGERUN_WORKER_DEVICE",
              show_envvar=True,
              help="ggml devices to offer (e.g. CUDA0, CPU); default: this board's GPUs, else its CPU.")
@click.option("--cache", default="default", show_default=True, envvar="EDGERUN_WORKER_CACHE", show_envvar=True,
              help="Weight cache directory ('default': $EDGERUN_HOME/rpc-cache; 'none': off). A head that loads "
                   "the same model again sends hashes instead of weights.")
@click.option("--allow-network", is_flag=True, envvar="EDGERUN_WORKER_ALLOW_NETWORK", show_envvar=True,
              help="DANGEROUS: listen on a non-loopback --host. Anyone who can connect can run code on this board.")
def worker(host, port, threads, devices, cache, allow_network):
    """Lend this board's memory and compute to a head (`--rpc` of generate/chat/serve): a ggml-rpc worker."""
    if check_host(host, allow_network):
        click.echo(f"WARNING: {NETWORK_WARNING.format(addr=f'{host}:{port}')}", err=True)
    cfg = WorkerConfig(host=host, port=port, threads=threads, allow_network=allow_network, cache=cache,
                       devices=tuple(d.strip() for d in (devices or "").split(",") if d.strip()))
    run_worker(cfg, announce=lambda line: click.echo(f"{line} (one head at a time; Ctrl-C stops)", err=True))


@click.group("cluster")
def cluster_group() -> None:
    """A model split over several boards (llama.cpp's RPC backend): docs/cluster.md."""


@cluster_group.command("status")
@click.option("--rpc", required=True, metavar="HOST:PORT,...", help="The workers to ask.")
@click.option("--timeout", type=click.FloatRange(0.1, 60), default=3.0, show_default=True,
              help="Seconds to wait for each worker's handshake.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
def cluster_status(rpc, timeout, as_json):
    """Each worker's protocol version, devices, free/total memory and round-trip time (exit 2 if one fails)."""
    records = status(parse_endpoints(rpc), timeout=timeout)
    if as_json:
        click.echo(json.dumps(records, indent=1))
    else:
        click.echo("\n".join(format_table(records)))
    require_all(records)
