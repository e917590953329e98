"""helpers.preemption: a signal asks the loop to stop; the handlers are put back; ranks agree on the step."""

import os
import signal
import threading

import pytest

from helpers.distributed import world_of_one
from helpers.preemption import PREEMPTED_EXIT_CODE, StopRequest, exit_code_name


def test_sigterm_sets_the_request_instead_of_ending_the_process_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest()
    with stop.installed():
        assert not stop.requested and not stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal == signal.SIGTERM
        assert stop.agreed()
    assert signal.getsignal(signal.SIGTERM) is before


def test_other_signals_can_be_asked_for():
    stop = StopRequest()
    with stop.installed([signal.SIGUSR1]):
        os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.signal == signal.SIGUSR1


def test_installing_from_another_thread_is_refused_with_the_reason():
    errors = []

    def install():
        try:
            with StopRequest().installed():
                pass
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert errors and "main thread only" in errors[0]


def test_a_world_of_one_agrees_with_its_own_request():
    stop = StopRequest()
    with world_of_one():
        assert not stop.agreed()
        stop(signal.SIGTERM, None)
        assert stop.agreed()


@pytest.mark.parametrize(
    "code, words",
    [(0, "finished"), (PREEMPTED_EXIT_CODE, "start it again to resume"), (-9, "killed by SIGKILL"), (1, "exit code 1")],
)
def test_exit_codes_in_words(code, words):
    assert words in exit_code_name(code)


def test_the_preempted_exit_code_is_ex_tempfail():
    assert PREEMPTED_EXIT_CODE == getattr(os, "EX_TEMPFAIL", 75) == 75
