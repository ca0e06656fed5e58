"""`tinkerd serve`: the API, the control plane and the in-process engine on one machine."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading

import uvicorn

from tinkerd.cli import LOG_FORMAT
from tinkerd.cli.flags import add_flags, config_values
from tinkerd.config import ServerConfig
from tinkerd.errors import UserError

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    # The usage line would list ~50 flags before each error message; --help lists them.
    p = sub.add_parser("serve", help="run the server on embedded defaults (SQLite, in-process engine)",
                       usage="%(prog)s [options]",
                       description="Every option is a ServerConfig field (tinkerd/config.py, docs/configuration.md).")
    add_flags(p)
    p.set_defaults(func=run)


def build_config(args) -> ServerConfig:
    return ServerConfig(**config_values(args))


def build_app(config: ServerConfig, client=None):
    """Wire store, engine, control plane and API from one config. `client`: an engine client already
    started (`run` spawns the engine child before anything else); None starts one here."""
    from tinkerd.api.app import create_app
    from tinkerd.api.deps import AppState
    from tinkerd.api import legacy
    from tinkerd.artifacts import LocalArtifactStore
    from tinkerd.cli.tokenizers import Tokenizers
    from tinkerd.control.accounts import Accounts
    from tinkerd.control.audit import AuditLog
    from tinkerd.control.backpressure import QueueBudget
    from tinkerd.control.control import Control
    from tinkerd.control.diskspace import DiskReserve
    from tinkerd.control.quotas import Quotas
    from tinkerd.control.recovery import Recovery
    from tinkerd.control.residency import Residency
    from tinkerd.control.retention import FutureRetention
    from tinkerd.control.runs import Runs
    from tinkerd.control.stability import StabilityRecords
    from tinkerd.control.stepmetrics import StepMetrics
    from tinkerd.control.store.db import Store
    from tinkerd.control.tokens import Tokens

    from tinkerd.control import replicas

    config.data_dir.mkdir(parents=True, exist_ok=True)
    if client is None and config.role != "api":  # an api replica has no engine (docs/deployment.md)
        client = build_engine_client(config)
    store = Store.open(config)
    replicas.check(config.role, store)
    worker_id = replicas.worker_id(config.role)
    reserve = DiskReserve(config.data_dir, config.min_free_disk_bytes)
    artifacts = LocalArtifactStore(config.data_dir)  # checkpoints, snapshots, exports (tinkerd/artifacts.py)
    recovery = Recovery(store, artifacts, snapshot_interval_s=config.snapshot_interval_s,
                        snapshot_budget=config.snapshot_budget)
    # One audit log for the accounts' events and the checkpoints': only one instance folds failed
    # authentications in memory, and the audit route reads through it.
    audit = AuditLog(store)
    runs = Runs(store, artifacts, audit=audit)
    runs.refuse_under(reserve)
    control = Control(store, client, recovery, quotas=Quotas(store, config),
                      residency=Residency(store, recovery, config.session_expiry_s),
                      retention=FutureRetention(store, recovery, config.future_retrieved_grace_s,
                                                config.future_max_age_s, config.future_tombstone_s),
                      reserve=reserve, runs=runs, ephemeral_samplers_kept=config.ephemeral_samplers_kept,
                      worker_id=worker_id)
    if config.role != "all":
        replicas.use_database_notifier(control, store)
    control.budget = QueueBudget(config.max_queued_ops_per_model, config.max_queued_ops,
                                 count=control.futures.pending_count if config.role != "all" else None)
    control.scheduler.batch_tokens = config.train_batch_tokens
    control.scheduler.batch_wait_s = config.train_batch_wait_ms / 1000
    if not config.metrics:
        control.metrics.disable()
    if config.otlp_endpoint:
        from tinkerd.control.tracing import OpTracer

        control.metrics.tracer = OpTracer.otlp(config.otlp_endpoint)
    # Crash debris of checkpoint saves, swept with the snapshots' at start and after engine restarts.
    recovery.sweeps.append(lambda: runs.checkpoints.sweep_stale_temp(older_than_s=0))
    served = {m.name: m for m in replicas.served_models(config.role, store, client, worker_id, control.notifier)}
    accounts = Accounts(store, audit)
    records = StabilityRecords(store, config.recorded_sequence_ttl_s)
    control.results.recorders.append(records.record)
    control.results.recorders.append(StepMetrics(store).record)  # the console's curves (control/stepmetrics.py)
    app_state = AppState(config=config, control=control, runs=runs, served=served, accounts=accounts, records=records,
                         tokenizers=Tokenizers(served), tokens=Tokens.in_dir(config.data_dir))
    if config.role == "api":  # the driver's models, again whenever it announces them (a restart with others)
        def use(models: dict) -> None:
            app_state.served = app_state.tokenizers.served = models

        replicas.follow_served(control.notifier, store, use)
    legacy.convert(app_state)  # a data directory from before the op log: once, before control recovers
    return create_app(app_state), control


def build_engine_client(config: ServerConfig, wait: bool = True):
    """The EngineRouter over the engines serving config.base_models: one Ray actor each with
    --ray-address (engine/ray_engine.py), else the one embedded engine. wait=False (process engine
    only): return once the child is spawned; its first use waits."""
    from tinkerd.control.engines import EngineRouter

    if config.engine_ranks > 1 and (config.ray_address or config.engine != "process"):
        raise UserError("--engine-ranks above 1 needs the process engine (no --engine thread, no --ray-address)")
    if config.ray_address:
        from tinkerd.engine.ray_engine import ray_engines, shutdown

        return EngineRouter(ray_engines(config, logging.getLogger().getEffectiveLevel(), LOG_FORMAT), on_close=shutdown)
    return EngineRouter([_embedded_engine_client(config, wait)])


def _embedded_engine_client(config: ServerConfig, wait: bool):
    from tinkerd.artifacts import LocalArtifactStore

    if config.engine == "process":
        from tinkerd.engine.precision import Precision
        from tinkerd.engine.process import EngineSpec, ProcessEngineClient

        log.info("starting the engine process for %s", ", ".join(config.base_models))
        return ProcessEngineClient(EngineSpec(config.models_dir, tuple(config.base_models), config.max_lora_rank,
                                              config.torch_threads, config.sample_kv_cache_bytes,
                                              precision=Precision(config.device, config.dtype),
                                              log_level=logging.getLogger().getEffectiveLevel(), log_format=LOG_FORMAT,
                                              ranks=config.engine_ranks, artifacts=LocalArtifactStore(config.data_dir),
                                              activation_memory_bytes=config.activation_memory_bytes),
                                   wait=wait)
    import torch

    from tinkerd.engine.client import InProcessEngineClient
    from tinkerd.engine.engine import Engine
    from tinkerd.engine.malloc import keep_freed_memory
    from tinkerd.engine.precision import Precision
    from tinkerd.engine.sampler.sample import SamplerConfig

    keep_freed_memory()  # as the engine process does (engine/malloc.py)

    def build() -> Engine:  # on the engine's own thread (InProcessEngineClient.on_one_thread)
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        engine = Engine(config.models_dir, config.max_lora_rank, SamplerConfig(kv_cache_bytes=config.sample_kv_cache_bytes),
                        Precision(config.device, config.dtype), LocalArtifactStore(config.data_dir),
                        config.activation_memory_bytes)
        engine.load_base_models(config.base_models)
        return engine

    return InProcessEngineClient.on_one_thread(build)


def local_key(config: ServerConfig, accounts) -> str | None:
    """The key to print in the ready line. No server starts open: on a first start with no keys,
    one is created for the local account and kept (mode 0600) in the data directory."""
    path = config.data_dir / "local_api_key"
    if config.api_key:
        if accounts.verify(config.api_key) is None:
            from tinkerd.errors import UserError

            try:
                accounts.create_key("serve --api-key", key=config.api_key)
            except UserError:  # replicas starting together on one database: another registered it
                if accounts.verify(config.api_key) is None:
                    raise
        return config.api_key
    if not accounts.has_keys():
        key = accounts.create_key("local").key
        path.write_text(key + "\n")
        path.chmod(0o600)
        return key
    return path.read_text().strip() if path.exists() else None


def hub_unreachable() -> bool:
    """Whether clients here should be told HF_HUB_OFFLINE=1 (engine/model/hub.py).

    Then the ready line tells them so: their `get_tokenizer()` resolves a hub name from the local
    cache at once (engine/model/hub_alias.py), where huggingface_hub would otherwise retry the
    unreachable hub for about two minutes and log a warning for every retry."""
    from tinkerd.engine.model import hub

    return hub.unreachable()


def uvicorn_config(app, config: ServerConfig) -> uvicorn.Config:
    """uvicorn with tinkerd's connection limits. The protocol is h11 with request deadlines
    (api/connection.py), not the faster httptools: uvicorn has no deadline for reading a request,
    and h11 takes a head size limit. Requests here are few and long (a step, a long-poll), so the
    parser's speed does not show."""
    from tinkerd.api.connection import TimedH11Protocol

    return uvicorn.Config(
        app, log_level="warning",
        http=TimedH11Protocol.with_timeouts(config.request_head_timeout_s, config.request_body_timeout_s),
        timeout_keep_alive=config.keep_alive_timeout_s, limit_concurrency=config.max_connections,
        backlog=config.listen_backlog, h11_max_incomplete_event_size=config.max_request_head_bytes)


def warn_if_few_file_descriptors(max_connections: int) -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    # ~100 descriptors go to the database, the engine pipe, model files and logs.
    if soft != resource.RLIM_INFINITY and soft < max_connections + 100:
        log.warning("the open-file limit (ulimit -n) is %d, below --max-connections %d plus ~100 the server "
                    "itself uses: past it accept() fails and new clients wait unanswered instead of getting a 503",
                    soft, max_connections)


def import_sdk_types_without_torch() -> None:
    """Import the SDK's types (which the API's wire schemas are) without torch: `tinker.types`
    imports torch only to accept torch tensors (`try: import torch`), which a server never receives
    (bodies are JSON and protobuf). Without it the server starts ~1.5 s sooner (2 shared cores,
    torch 2.x) and ~300 MB smaller, and the engine child, which needs torch, imports it meanwhile.
    Only for --engine process: --engine thread imports torch in this process anyway."""
    if "tinker" in sys.modules or "torch" in sys.modules:
        return  # too late, or torch is here anyway
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        import tinker.types  # noqa: F401
    finally:
        del sys.modules["torch"]  # a later `import torch` (none in this process) works as usual


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the app is ready (see serve). Made with IPPROTO_TCP named:
    asyncio sets TCP_NODELAY only on accepted sockets whose proto is IPPROTO_TCP, and an accepted
    socket inherits the listener's (0 by default). Without it a response's head and body went out
    in two segments, Nagle held the body for the client's delayed ACK, and every request on a
    kept-alive connection took ~44 ms, a health check included (every SDK submit and poll)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def run(args) -> int:
    """Listen at once, build the rest behind a StartupGate (api/gate.py), then print the ready line.

    Order, for a restart after a crash (tiny model, 2 shared cores, numbers from issue 16 part 5):
    the engine child is spawned first (its torch + transformers imports and model load take ~6 s);
    the port is bound and answers at once, holding requests, so SDK clients stop backing off; the
    API imports, store, key and hub check run meanwhile on a thread; then the engine's first use
    waits for its child, and recovery replays. Ready (the ready line) is when the app serves."""
    config = build_config(args)
    client = build_engine_client(config, wait=False) if config.role != "api" else None
    if config.engine == "process":
        import_sdk_types_without_torch()
    from tinkerd.api.gate import StartupGate

    sock = listening_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"
    gate = StartupGate()
    server = uvicorn.Server(uvicorn_config(gate, config))
    warn_if_few_file_descriptors(config.max_connections)
    state: dict = {}

    def start_control_plane() -> None:
        # Off the event loop: imports, SQLite, the engine's start and replay block for seconds.
        from tinkerd.control.checkpoints import CheckpointSweeper

        app, control = build_app(config, client)
        state["control"] = control
        runs = app.state.tinkerd.runs
        if config.role != "api":  # one process deletes expired checkpoints' files: the driver
            state["sweeper"] = CheckpointSweeper(runs.checkpoints, config.checkpoint_sweep_interval_s)
        state["key"] = local_key(config, app.state.tinkerd.accounts)
        # A resolver can take seconds to fail: asked here, off the loop, while the engine starts.
        state["offline_env"] = " HF_HUB_OFFLINE=1" if hub_unreachable() else ""
        control.start()  # recovery: rebuilds adapters, queues pending ops again
        if "sweeper" in state:
            state["sweeper"].start()
        state["app"] = app

    async def main() -> None:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        starting = _in_thread(start_control_plane)
        try:
            await asyncio.wait({serving, starting}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():  # stopped (Ctrl-C, SIGTERM) while starting
                return
            starting.result()  # a start that failed raises here (EngineStartFailed: the engine's reason)
            await gate.open(state["app"])
            state["ready"] = True
            key = state["key"]
            models = state["app"].state.tinkerd.served.values()
            names = ", ".join(m.name for m in models if not m.unavailable)
            refused = [m.name for m in models if m.unavailable]  # each logged with its reason by the engine
            if refused:
                names += f" (not served: {', '.join(refused)})"
            print(
                f"tinkerd ready at {url} serving {names}\n"
                f"  export TINKER_BASE_URL={url} TINKER_API_KEY={key or '<a key from: tinkerd keys create --name NAME>'}"
                f"{state['offline_env']}",
                flush=True,
            )
            await serving
        finally:
            if not starting.done():  # the start thread waits on the engine child or replays on it: end that
                getattr(client, "kill", lambda: None)()
                await asyncio.wait({starting})
                starting.exception()  # its EngineCrashed is expected: retrieved, so asyncio logs nothing
            if not serving.done():
                server.should_exit = True
                await asyncio.wait({serving})
            await gate.close()
            if "sweeper" in state:
                state["sweeper"].stop()
            if "control" in state:
                state["control"].stop()
            elif client is not None:
                client.close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        # uvicorn shuts down on Ctrl-C, then raises the signal again once it is done; by then main()'s
        # finally has stopped the control plane and the engine process: a clean stop, not an error.
        if not state.get("ready"):
            raise  # Ctrl-C before the server was ready: cli/main.py says "interrupted"
        print("tinkerd serve: stopped", file=sys.stderr, flush=True)
    return 0


def _in_thread(fn) -> asyncio.Future:
    """Run fn() on a daemon thread: unlike the loop's executor, one blocked on a dead start never
    holds the process at exit."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not done.done():
            done.set_result(None) if error is None else done.set_exception(error)

    def target() -> None:
        error = None
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  handed to the loop, raised by whoever awaits
            error = e
        try:
            loop.call_soon_threadsafe(settle, error)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass

    threading.Thread(target=target, name="tinkerd-start", daemon=True).start()
    return done
