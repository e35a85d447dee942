"""Horovod's elastic loop as hvd-cpu runs it (horovodrun --host-discovery-script): the job's
body runs again whenever ranks are lost or hosts come and go, from the state every rank takes
from rank 0 (runtime/horovod.py's ElasticState; what is kept is training/elastic.py's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hvd_cpu.errors import RunFailed
from hvd_cpu.runtime import horovod


def run_elastic(
    state: horovod.ElasticState,
    body: Callable[[], Any],
    max_restarts: int,
    before_reset: Callable[[], None],
) -> Any:
    """Run `body` until it returns, on whichever ranks there are: when a rank is lost, the
    survivors roll back to the last commit; when ranks join or go, Horovod starts again
    with the new set, every rank takes rank 0's state, and `body` runs again. After more
    than `max_restarts` lost ranks, RunFailed (as torchrun's --max-restarts).

    This is hvd.elastic.run with one change: it syncs after every reset. Horovod skips the
    sync when hosts were only removed, and when some ranks see that as a notice and others
    as a failed collective, those that sync wait forever for those that do not (#3494).
    """
    horovod.listen_for_host_updates(state)
    try:
        while True:
            try:
                state.sync()
                return body()
            except horovod.PeerLost as lost:
                before_reset()
                state.restore()
                state.failures += 1
                if state.failures > max_restarts:
                    raise RunFailed(
                        f"gave up after losing ranks {state.failures} time(s) "
                        f"(--max-restarts {max_restarts})"
                    ) from lost
            except horovod.HostsUpdated:
                pass
            before_reset()  # the ranks change: the next pass watches the new ones
            horovod.restart()
            state.on_reset()
    finally:
        horovod.stop_listening(state)
