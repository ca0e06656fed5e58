"""EngineClient implementations that live in the engine package (they may import torch)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tinkerd.engine.engine import Engine
from tinkerd.engine.losses import supported_losses
from tinkerd.types import ServedModel, StepBatch, StepOutput


class InProcessEngineClient:
    """The embedded default: the engine runs on the caller's thread, or on `runner`'s one thread
    (`on_one_thread`)."""

    def __init__(self, engine: Engine, runner: ThreadPoolExecutor | None = None):
        self.engine = engine
        self._runner = runner

    @classmethod
    def on_one_thread(cls, build) -> "InProcessEngineClient":
        """An engine built by `build()` whose every torch call, its build and each step, runs on one
        thread of its own (`serve --engine thread`). libgomp keeps an OpenMP thread pool for each
        thread that starts a parallel region, and once its threads outnumber the cores it lets them
        spin only briefly before sleeping, so every small parallel op pays a wake-up. The server's
        main thread loaded the model (a pool of its own, kept for its life) and the control thread
        ran the steps: SmolLM2 2 x 256, 2 threads, through the SDK, 2566 ms a step against 1879 for
        the process engine; an elementwise op ran ~2x as long while another live thread held a pool."""
        runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinkerd-torch")
        try:
            return cls(runner.submit(build).result(), runner)
        except BaseException:
            runner.shutdown(wait=False)
            raise

    def _on_engine_thread(self, fn, *args):
        return fn(*args) if self._runner is None else self._runner.submit(fn, *args).result()

    def step(self, batch: StepBatch) -> StepOutput:
        return self._on_engine_thread(self.engine.step, batch)

    def models(self) -> list[ServedModel]:
        return [
            ServedModel(
                name=rt.name,
                tokenizer_id=rt.loaded.tokenizer_id,
                max_context_length=rt.loaded.max_context_length,
                arch=type(rt.model).__name__,
                loss_fns=tuple(supported_losses()),
                tokenizer_dir=rt.loaded.tokenizer_dir,
                vision=rt.loaded.vision.spec if rt.loaded.vision is not None else None,
            )
            for rt in self.engine.runtimes.values()
        ] + [ServedModel(name=name, tokenizer_id="", max_context_length=0, arch="", unavailable=reason)
             for name, reason in self.engine.refused.items()]

    def close(self) -> None:
        try:
            self._on_engine_thread(self.engine.close)
        finally:
            if self._runner is not None:
                self._runner.shutdown(wait=True)
