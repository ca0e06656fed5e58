"""`tinkerd serve`: the API, the control plane and the in-process engine on one machine."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import uvicorn

from tinkerd.config import DEFAULT_BASE_MODEL, ServerConfig

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the server on embedded defaults (SQLite, in-process engine)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed in the ready line)")
    p.add_argument("--data-dir", type=Path, default=None, help="default: $TINKERD_DATA_DIR or ~/.tinkerd")
    p.add_argument("--base-model", action="append", dest="base_models", default=None,
                   help=f"a model to serve; repeatable (default: {DEFAULT_BASE_MODEL})")
    p.add_argument("--api-key", default=None, help="the key clients send (default: tml-tinkerd-local)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.set_defaults(func=run)


def build_config(args) -> ServerConfig:
    values = {"host": args.host, "port": args.port}
    if args.data_dir is not None:
        values["data_dir"] = args.data_dir.expanduser().resolve()
    if args.base_models:
        values["base_models"] = args.base_models
    if args.api_key:
        values["api_key"] = args.api_key
    if args.threads:
        values["torch_threads"] = args.threads
    return ServerConfig(**values)


def build_app(config: ServerConfig):
    """Wire store, engine, control plane and API from one config."""
    import torch

    from tinkerd.api.app import create_app
    from tinkerd.api.deps import AppState
    from tinkerd.control.control import Control
    from tinkerd.control.runs import Runs
    from tinkerd.control.store.db import Store
    from tinkerd.engine.client import InProcessEngineClient
    from tinkerd.engine.engine import Engine

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    engine = Engine(config.models_dir, config.max_lora_rank)
    for name in config.base_models:
        log.info("loading base model %s", name)
        engine.load_base_model(name)
    client = InProcessEngineClient(engine)
    store = Store.sqlite(config.db_path)
    control = Control(store, client)
    runs = Runs(store, config.checkpoints_dir)
    served = {m.name: m for m in client.models()}
    return create_app(AppState(config=config, control=control, runs=runs, served=served)), control


def run(args) -> int:
    config = build_config(args)
    app, control = build_app(config)
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=75))

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        print(
            f"tinkerd ready at {url} serving {', '.join(config.base_models)}\n"
            f"  export TINKER_BASE_URL={url} TINKER_API_KEY={config.api_key}",
            flush=True,
        )

    async def main() -> None:
        control.start()
        task = asyncio.create_task(announce())
        try:
            await server.serve(sockets=[sock])
        finally:
            task.cancel()
            control.stop()

    asyncio.run(main())
    return 0
