"""Finished jobs: where executors hand them over, where a host waits for them, and how they
become results.

CPU lanes (and a CUDA job whose copies could not be enqueued) push a finished job to the
engine's :class:`_Completions`; a host waits on it for CPU jobs (one condition per engine, not
an event per job: a step may make hundreds of jobs) and on end events for CUDA jobs;
``poll`` collects each finished job's :class:`~kvoffload.transfer.TransferResult` exactly once.
"""

from __future__ import annotations

import threading
import time

from kvoffload.errors import TransferError
from kvoffload.transfer.jobs import TransferResult, _Job


class _Completions:
    """Thread-safe list of finished jobs, drained by ``poll``; a host waits on it for a job
    (one condition per engine, not an event per job: a step may make hundreds of jobs)."""

    def __init__(self) -> None:
        self._lock = threading.Condition(threading.Lock())
        self._jobs: list[_Job] = []

    def push(self, job: _Job) -> None:
        """Hand over a finished job: it is marked finished and its waiters wake."""
        with self._lock:
            job.finished = True
            self._jobs.append(job)
            self._lock.notify_all()

    def wait(self, job: _Job, timeout: float | None) -> bool:
        """Wait until ``job`` was pushed (at most ``timeout`` seconds); whether it was."""
        with self._lock:
            return self._lock.wait_for(lambda: job.finished, timeout)

    def push_back(self, jobs: list[_Job]) -> None:
        """Return drained jobs that could not be handed out (they come first next time)."""
        with self._lock:
            self._jobs[:0] = jobs

    def drain(self) -> list[_Job]:
        with self._lock:
            jobs, self._jobs = self._jobs, []
        return jobs

    def block(self, jobs: list[_Job], timeout: float | None) -> None:
        """Wait on the host for ``jobs`` (CPU jobs on this list, CUDA jobs on their end event),
        at most ``timeout`` seconds in all; raises TransferError naming the jobs still running.
        Call it without the engine's lock."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        for job in jobs:
            if job.end_event is None:
                left = None if deadline is None else max(0.0, deadline - time.perf_counter())
                if not self.wait(job, left):
                    raise _timeout_error(jobs)
            elif deadline is None:
                job.end_event.synchronize()
                _mark_cuda_done(job)
            else:
                while not job.end_event.query():
                    if time.perf_counter() > deadline:
                        raise _timeout_error(jobs)
                    time.sleep(1e-4)
                _mark_cuda_done(job)

    def collect(
        self, inflight: dict[int, _Job], stats: dict[str, int], *, drain: bool = False
    ) -> list[TransferResult]:
        """Remove the finished jobs (pushed here, or CUDA jobs whose end event passed; all
        of them with ``drain``) from ``inflight``, count them in ``stats`` and return their
        results. Call it with the engine's lock held.

        All or nothing: if anything interrupts it (an exception from a signal handler), every
        job it took is put back, so a result is never lost.
        """
        finished = self.drain()
        taken: list[_Job] = []
        try:
            for job in inflight.values():
                if job.end_event is not None and (drain or job.end_event.query()):
                    _mark_cuda_done(job)
                    finished.append(job)
            results = []
            counts = dict(stats)
            for job in finished:
                if inflight.get(job.job_id) is not job:
                    continue
                result = job.result()
                counts["copies"] += result.copies
                counts["jobs_ok" if result.ok else "jobs_failed"] += 1
                counts["bytes_stored" if job.kind == "store" else "bytes_loaded"] += result.bytes
                results.append(result)
                taken.append(job)
            for job in taken:
                del inflight[job.job_id]
            stats.update(counts)
        except BaseException:
            for job in taken:
                inflight[job.job_id] = job
            self.push_back([j for j in finished if j.end_event is None])
            raise
        return results


def _mark_cuda_done(job: _Job) -> None:
    """The host saw a CUDA job's end event pass: its time ends now (once)."""
    if job.t_done is None:
        job.t_done = time.perf_counter()


def _is_done(job: _Job) -> bool:
    if job.end_event is not None:
        return bool(job.end_event.query())
    return job.finished


def _timeout_error(jobs: list[_Job]) -> TransferError:
    running = [j.job_id for j in jobs if not _is_done(j)]
    return TransferError(f"wait timed out with jobs {running} still running")
