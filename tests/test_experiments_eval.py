import inspect

import matplotlib.pyplot as plt
import pytest

from helpers.experiments_eval import SPEC, EvalRun, run_experiment, sweep_batch_sizes, sweep_threads
from helpers.inference import num_threads
from helpers.knobs import check_values

SMALL = dict(seed=3, epochs=1, channels=4, dropout=0.2, max_batch_size=16, max_threads=1, repeat=3, compile=False)
# One thread: on a busy machine, two threads per process can make these small runs many times slower.


def test_sweep_batch_sizes_are_powers_of_four_up_to_the_largest():
    assert sweep_batch_sizes(256) == [1, 4, 16, 64, 256]
    assert sweep_batch_sizes(16) == [1, 4, 16]
    assert sweep_batch_sizes(1) == [1]
    assert sweep_batch_sizes(100) == [1, 4, 16, 64, 100]


def test_sweep_threads_are_powers_of_two_up_to_the_most():
    assert sweep_threads(1) == [1]
    assert sweep_threads(2) == [1, 2]
    assert sweep_threads(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("function", [sweep_batch_sizes, sweep_threads])
@pytest.mark.parametrize("bad", [0, -2, 2.0, True])
def test_sweeps_reject_bad_limits(function, bad):
    with pytest.raises(ValueError, match="must be a positive int"):
        function(bad)


def test_the_knobs_accept_the_experiment_defaults():
    defaults = {name: p.default for name, p in inspect.signature(run_experiment).parameters.items()
                if p.kind is p.POSITIONAL_OR_KEYWORD}
    assert set(defaults) == set(SPEC)
    assert check_values(SPEC, defaults) == defaults


def test_run_experiment_trains_evaluates_and_times():
    with num_threads(1):
        run = run_experiment(**SMALL, device="cpu", show=False, progress=False)
    assert isinstance(run, EvalRun)
    assert 0.0 <= run.metrics["accuracy"] <= 1.0 and run.metrics["samples"] == 450
    assert run.metrics["confusion_matrix"].sum() == 450
    assert [(r["batch_size"], r["threads"]) for r in run.sweep] == [(1, 1), (4, 1), (16, 1)]
    assert run.gpu_sweep == [] and run.compiled is None
    assert len(run.history) == 1
    assert "accuracy=" in repr(run) and "Sequential" not in repr(run)


def test_run_experiment_shows_output_when_asked(capsys):
    with num_threads(1):
        run_experiment(**SMALL, device="cpu", show=True, progress=False)
    out = capsys.readouterr().out
    assert "accuracy" in out and "latency_ms" in out and "torch.compile not timed" in out
    plt.close("all")


def test_run_experiment_rejects_bad_knob_values():
    with pytest.raises(ValueError, match="epochs must be in"):
        run_experiment(**{**SMALL, "epochs": 0}, show=False, progress=False)
    with pytest.raises(ValueError, match="max_batch_size must be one of"):
        run_experiment(**{**SMALL, "max_batch_size": 100}, show=False, progress=False)
