"""Who runs a step: the one object between the engine core and the model.

The core hands an executor each SchedulerOutput and gets the sampled tokens back. The local
executor runs the model in this process; a tensor-parallel executor hands the same step to every
rank of its group (rank 0 samples). The core never touches the model itself.
"""

from __future__ import annotations

from typing import Protocol

from app.engine.kv_cache import KVCacheConfig
from app.engine.scheduler import SchedulerOutput
from app.engine.structured import Grammars


class Executor(Protocol):
    vocab_size: int
    grammars: Grammars  # rank 0's: where structured outputs' grammars are compiled (its runner samples)

    def execute(self, output: SchedulerOutput):
        """Run one step; returns a RunnerOutput (sampled tokens and logprobs by request id)."""

    def time_forward(self, count: int, num_computed: int, decodes: bool = False) -> None:
        """A forward pass of `count` dummy tokens after `num_computed`, or of `count` one-token sequences
        (`decodes`): the step cost's calibration (model_runner.calibration_step)."""

    def check_workers(self) -> None:
        """ExecutorFailed where another rank has exited (called while the engine is idle)."""

    def stalled(self) -> tuple[int, float] | None:
        """(rank, seconds) a step has waited for a live rank that has not arrived; None (any thread may ask)."""

    def close(self) -> None:
        """Release what the executor started (worker processes, shared memory)."""


class ExecutorFailed(RuntimeError):
    """The executor cannot run steps any more (a TP rank died or the group broke): fatal to the engine."""


class LocalExecutor:
    """The whole model in this process."""

    def __init__(self, runner):
        self.runner, self.grammars = runner, runner.grammars
        self.vocab_size = runner.vocab_size

    def execute(self, output: SchedulerOutput):
        return self.runner.execute(output)

    def time_forward(self, count: int, num_computed: int, decodes: bool = False) -> None:
        self.runner.time_forward(count, num_computed, decodes)

    def check_workers(self) -> None:
        """Nothing to check: no other rank."""

    def stalled(self) -> tuple[int, float] | None:
        return None

    def close(self) -> None:
        self.grammars.close()


class TPExecutor:
    """Rank 0 of a TP group: broadcasts each step to the workers, then runs its own shard and samples.

    Any failure during a step is fatal (the ranks may be at different points of the step): the group
    is aborted, so every worker stops too, and ExecutorFailed ends the engine.
    """

    def __init__(self, runner, group, workers: list):
        self.runner, self.group, self.workers = runner, group, workers
        self.vocab_size, self.grammars = runner.vocab_size, runner.grammars

    def execute(self, output: SchedulerOutput):
        return self._step(output, lambda: self.runner.execute(output))

    def time_forward(self, count: int, num_computed: int, decodes: bool = False) -> None:
        from app.engine.model_runner import calibration_step

        step = calibration_step(count, num_computed, self.runner.block_size, decodes)
        self._step(step, lambda: self.runner.time_forward(count, num_computed, decodes))

    def _step(self, output: SchedulerOutput, run):
        """The workers get `output`, then this rank runs its part (`run`)."""
        from app.parallel.worker import encode_step

        try:
            self.group.broadcast(encode_step(output))
            return run()
        except Exception as exc:
            self.group.abort(f"TP rank 0: {type(exc).__name__}: {exc}")
            raise ExecutorFailed(f"tensor-parallel step failed: {exc}") from exc

    def check_workers(self) -> None:
        """ExecutorFailed where a worker has exited: checked while the engine is idle (a step's collectives see a
        dead peer themselves), so that a rank that dies between requests ends the engine then, not at the next
        request."""
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                self.group.abort(f"TP rank {rank} (pid {worker.pid}) exited")
                raise ExecutorFailed(f"TP rank {rank} (pid {worker.pid}) exited (code {worker.exitcode}) while the "
                                     "engine was idle")

    def stalled(self) -> tuple[int, float] | None:
        """(rank, seconds) where this rank has been waiting that long in a step's collective for a live rank that
        has not arrived (stopped, or stuck), else None; read from the heartbeat's thread."""
        seconds = self.group.native.waiting_seconds()  # (then the peer: set before the time it waits from)
        peer = self.group.native.waiting_peer
        return (peer, seconds) if seconds > 0 else None

    def close(self) -> None:
        from app.parallel.worker import Stop, encoder

        self.grammars.close()
        try:
            self.group.broadcast(encoder.encode(Stop()), 5.0)
        except Exception:  # a group that already failed: the workers are stopping anyway
            pass
        from app.bootstrap.runtime import remove_openmp_files

        for worker in self.workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
                worker.join()
            remove_openmp_files(worker.pid)  # what its OpenMP runtime left in /dev/shm if it did not exit cleanly
        self.group.close()


def local_engine(model, kv: KVCacheConfig, scheduler_cfg, model_id: str, tokenizer_json=None):
    """An EngineCore running `model` in this process (tests); `tokenizer_json` as ModelRunner's."""
    from app.engine.core import EngineCore
    from app.engine.model_runner import ModelRunner

    runner = ModelRunner(model, kv, scheduler_cfg.max_num_batched_tokens, scheduler_cfg.max_num_seqs,
                         tokenizer_json=tokenizer_json)
    return EngineCore(LocalExecutor(runner), scheduler_cfg, kv, model_id)
