"""`agentkv fleet up` stops everything it started on SIGTERM and SIGHUP, as on Ctrl-C."""

from __future__ import annotations

import os
import signal

import pytest

from agentkv.cli.fleet import stop_on_terminate


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminate_signal_unwinds_like_ctrl_c(sig: signal.Signals) -> None:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        stop_on_terminate()
        # Checked first: without a handler the signal below would end the test run itself.
        assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig)
            signal.sigtimedwait([], 0)  # give the handler its turn (it runs between bytecodes)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
