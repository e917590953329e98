"""helpers.hangs on stacks as faulthandler writes them: the main thread found among others, the collective a rank
waits in and its call site, and the rank that is not where the others wait."""

from helpers.hangs import Place, hang_report, main_thread_frames, place

C10D = "/env/torch/distributed/distributed_c10d.py"
LOGGER = "/env/torch/distributed/c10d_logger.py"
QUEUE_THREAD = (
    'Thread 0x00007f01 (most recent call first):\n  File "/usr/lib/python3.11/threading.py", line 327 in wait\n'
)


def stack(*frames: str) -> str:
    """A faulthandler dump: a queue thread, then the main thread with `frames` (innermost first)."""
    lines = "".join(f"  {frame}\n" for frame in frames)
    return f"{QUEUE_THREAD}\nCurrent thread 0x00007f00 (most recent call first):\n{lines}"


IN_ALL_REDUCE = stack(
    f'File "{C10D}", line 4174 in all_reduce',
    f'File "{LOGGER}", line 83 in wrapper',
    'File "/tmp/lesson_hang.py", line 9 in worker',
    'File "/course/helpers/processes.py", line 103 in _run_rank',
)
AT_THE_END = stack(
    f'File "{C10D}", line 6607 in barrier',
    f'File "{LOGGER}", line 83 in wrapper',
    'File "/course/helpers/distributed.py", line 138 in finish_run',
    'File "/course/helpers/processes.py", line 116 in _run_rank',
)
ELSEWHERE = stack('File "/tmp/lesson_hang.py", line 14 in slow_part', 'File "/tmp/lesson_hang.py", line 10 in worker')


def test_the_main_thread_is_the_one_running_the_rank():
    frames = main_thread_frames(IN_ALL_REDUCE)
    assert frames[0] == (C10D, 4174, "all_reduce") and frames[-1][2] == "_run_rank"
    assert main_thread_frames("") == []


def test_a_place_names_the_collective_and_its_caller_outside_torch():
    in_all_reduce = place(main_thread_frames(IN_ALL_REDUCE))
    assert in_all_reduce == Place("all_reduce", "lesson_hang.py:9 in worker")
    assert in_all_reduce.words == "waiting in dist.all_reduce, called at lesson_hang.py:9 in worker"
    assert place(main_thread_frames(ELSEWHERE)).words == "at lesson_hang.py:14 in slow_part"
    assert place([]) == Place(None, None) and place([]).words == "its stack could not be read"
    assert place([(C10D, 1, "barrier")]).words == "waiting in dist.barrier"


def test_ranks_in_one_collective_called_from_two_places_are_not_one_place():
    other_caller = IN_ALL_REDUCE.replace("line 9 in worker", "line 12 in worker")
    report, _ = hang_report([0, 1, 2], [], {0: IN_ALL_REDUCE, 1: other_caller, 2: IN_ALL_REDUCE}, 3)
    assert "rank(s) [1] never reached the dist.all_reduce at lesson_hang.py:9 in worker that rank(s) [0, 2]" in report


def test_the_rank_that_skipped_the_collective_is_named():
    report, places = hang_report([0], [1], {0: IN_ALL_REDUCE, 1: AT_THE_END}, 2)
    assert places[1] == "its worker returned; waiting for the others at the end of the run"
    assert "rank(s) [1] never reached the dist.all_reduce at lesson_hang.py:9 in worker that rank(s) [0]" in report


def test_ranks_waiting_at_one_place_name_the_one_elsewhere_and_all_in_one_place_name_none():
    report, places = hang_report([0, 1, 2], [], {0: IN_ALL_REDUCE, 1: ELSEWHERE, 2: IN_ALL_REDUCE}, 3)
    assert places[1] == "at lesson_hang.py:14 in slow_part"
    assert "rank(s) [1] never reached" in report and "that rank(s) [0, 2] wait in" in report
    report, _ = hang_report([0, 1], [], {0: IN_ALL_REDUCE, 1: IN_ALL_REDUCE}, 2)
    assert "never reached" not in report and report.count("waiting in dist.all_reduce") == 2


def test_a_rank_without_a_stack_says_so():
    report, places = hang_report([0, 1], [], {0: IN_ALL_REDUCE}, 2)
    assert places[1] in ("its stack could not be read", "no stack (stacks need SIGUSR1: Linux or macOS)")
    assert "rank(s) [1] never reached" in report
