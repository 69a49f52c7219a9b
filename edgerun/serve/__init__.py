"""The service: the OpenAI protocol, the ASGI app, running it, the scheduler, metrics and systemd glue."""
