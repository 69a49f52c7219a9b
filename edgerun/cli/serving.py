"""`edgerun serve`: the OpenAI-compatible HTTP server (its options come from serve/settings.py's table)."""

from __future__ import annotations

import logging

import click

from ..errors import EdgerunError
from ..config import parse_gamma
from ..serve import settings as serve_settings


@click.command()
@serve_settings.click_options
@click.pass_context
def serve(ctx, **options):
    """Serve an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /health, /metrics).

    Every option can also come from its EDGERUN_* environment variable (the systemd unit reads them
    from /etc/edgerun/edgerun.env). The socket is bound at once and the models load in the
    background: /health answers 503 until they are ready.
    """
    try:    # lazily: uvicorn and fastapi are the optional 'serve' extra, refused here with a clear message
        from ..serve.run import precheck, serve as run_server
    except ImportError as e:
        raise EdgerunError(f"`edgerun serve` needs the 'serve' extra ({e.name} is not installed): "
                           f"pip install 'edgerun[serve]'") from e

    if ctx.find_root().params.get("verbose", 0) == 0:
        logging.getLogger("edgerun").setLevel(logging.INFO)
        logging.getLogger("uvicorn").setLevel(logging.INFO)
    options["gamma"] = parse_gamma(options["gamma"])      # parsed once, before the socket is bound
    config = serve_settings.config_from_options(options)
    precheck(config)
    run_server(config)
