"""Several vLLM servers behind one engine: prompts are dealt over them, and each request carries its prompt's own
seed, so the samples do not depend on the dealing (tested: two servers give one server's samples). Weight updates
and version checks go to every server. A server that stops answering mid-round is dropped with a one-line note
(``notes``) and its unanswered prompts go to the others; when none is left, one line names every URL."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from prefpack.generation.engine import GenerationError, PromptJob, Sample, SamplingSettings
from prefpack.generation.vllm_engine import CHUNK_REQUESTS, ServerUnreachable, VllmEngine


class VllmPool:
    """The ``GenerationEngine`` of several ``VllmEngine`` s (one per server, some possibly started by prefpack:
    ``close`` stops them). The servers must serve the same model."""

    name = "vllm"
    batch_dependent = False  # each request carries its prompt's seed, whichever server answers it

    def __init__(self, engines: Sequence[VllmEngine]):
        if not engines:
            raise GenerationError("a pool of vLLM servers needs at least one server")
        models = {e.base_model for e in engines}
        if len(models) > 1:
            raise GenerationError("the vLLM servers serve different models (" + ", ".join(
                f"{e.url}: {e.base_model}" for e in engines) + "); start them on the same folder, or give each the "
                "same --served-model-name")
        self.engines, self.live, self.failed = list(engines), list(engines), {}
        self.notes: list[str] = []

    @classmethod
    def from_urls(cls, urls: Sequence[str], **engine_kwargs) -> VllmPool:
        """One engine per URL; a URL that does not answer is refused (a pool starts whole)."""
        return cls([VllmEngine(url, **engine_kwargs) for url in urls])

    @property
    def batch_prompts(self) -> int:
        return CHUNK_REQUESTS * sum(e.concurrency for e in self.live)

    @property
    def model(self) -> str:
        return self.live[0].model if self.live else self.engines[0].model

    def describe(self) -> dict:
        out = {"model": self.model, "urls": [e.url for e in self.engines],
               "concurrency": [e.concurrency for e in self.engines]}
        versions = {e.version for e in self.live}
        if versions != {None}:
            out["weights_version"] = versions.pop() if len(versions) == 1 else sorted(map(str, versions))
        started = [e.server.describe() for e in self.engines if e.server is not None]
        if started:
            out["servers"] = started
        return out

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def _drop(self, engine: VllmEngine, exc: ServerUnreachable) -> None:
        """Take a server that did not answer out of the pool, with a note; none left is one line naming all."""
        if engine in self.live:
            self.live.remove(engine)
            self.failed[engine.url] = str(exc)
            self.notes.append(f"the vLLM server at {engine.url} stopped answering and was dropped; "
                              f"{len(self.live)} of {len(self.engines)} servers remain ({exc})")
        if not self.live:
            raise GenerationError("no vLLM server is left: " + "; ".join(
                f"{url}: {why}" for url, why in self.failed.items()).replace("\n", " "))

    def _each(self, call) -> None:
        """``call(engine)`` on every live server at once (a reload takes a while on each); a server that does not
        answer is dropped, any other failure raised."""
        with ThreadPoolExecutor(max_workers=len(self.live)) as ex:
            futures = {ex.submit(call, e): e for e in list(self.live)}
        errors = []
        for future, engine in futures.items():
            exc = future.exception()
            if isinstance(exc, ServerUnreachable):
                self._drop(engine, exc)
            elif exc is not None:
                errors.append(exc)
        if errors:
            raise errors[0]

    def update_weights(self, folder: str | os.PathLike, version: str) -> None:
        self._each(lambda e: e.update_weights(folder, version))

    def load_adapter(self, folder: str | os.PathLike, version: str) -> None:
        self._each(lambda e: e.load_adapter(folder, version))

    def check_version(self, expected: str) -> None:
        self._each(lambda e: e.check_version(expected))

    def generate(self, jobs: Sequence[PromptJob], settings: SamplingSettings) -> list[list[Sample]]:
        if not jobs:
            return []
        self._each(VllmEngine.check_served)
        results: list[list[Sample] | None] = [None] * len(jobs)
        executors = {e: ThreadPoolExecutor(max_workers=e.concurrency) for e in self.live}
        pending: dict[Future, tuple[int, VllmEngine]] = {}

        def deal(indices: list[int]) -> None:
            for k, i in enumerate(indices):
                engine = self.live[k % len(self.live)]
                pending[executors[engine].submit(engine.sample, jobs[i], settings)] = (i, engine)

        try:
            deal(list(range(len(jobs))))
            while pending:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                redo = []
                for future in done:
                    i, engine = pending.pop(future)
                    exc = future.exception()
                    if exc is None:
                        results[i] = future.result()
                        continue
                    if not isinstance(exc, ServerUnreachable):
                        raise exc
                    self._drop(engine, exc)
                    redo.append(i)
                for future, (i, engine) in list(pending.items()):  # a dropped server's queued requests move too
                    if engine not in self.live and future.cancel():
                        del pending[future]
                        redo.append(i)
                deal(sorted(redo))
        finally:  # on a failure, the requests not yet sent are not sent
            for ex in executors.values():
                ex.shutdown(wait=True, cancel_futures=True)
        return results  # type: ignore[return-value]
