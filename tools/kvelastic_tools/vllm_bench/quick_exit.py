"""Leave a process that loaded torch and vLLM without its interpreter's teardown.

Once its work is done, such a process spends seconds tearing the interpreter
down (freeing every module and object of torch and vLLM) after its ``atexit``
handlers have run: on the 2-core test machine 3 to 4 s for a bare
``from vllm import LLM``, 6 to 13 s for an engine's front end (its exit
measured 7.7 to 14.7 s against 1.9 s without the teardown). No one observes
that teardown: the engine's shutdown, the plugin's unregistration and
everything else that ``atexit`` runs still run, in their order.

Usage, in a script that starts engines::

    from kvelastic_tools.vllm_bench import quick_exit   # first: before vLLM registers its handlers
    ...
    main()
    quick_exit.finish()

``finish`` marks the work done; the handler this module registers on import
(registered before any of vLLM's, so it runs after them: ``atexit`` runs the
last registered first) then flushes stdout and stderr and ends the process
with status 0. A script that fails never reaches ``finish``: it exits as
Python exits, with its traceback and status 1. A process forked from one that
called ``finish`` (vLLM's engine processes start before it) is unaffected:
they end through their own exit paths.
"""

from __future__ import annotations

import atexit
import os
import sys

_finished_pid: int | None = None


def finish() -> None:
    """This process's work ended normally: at exit, after every ``atexit``
    handler, skip the interpreter's teardown (status 0)."""
    global _finished_pid
    _finished_pid = os.getpid()


def _leave() -> None:
    if _finished_pid != os.getpid():
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # closed, or its reader is gone: nothing left to flush
            pass
    os._exit(0)


atexit.register(_leave)
