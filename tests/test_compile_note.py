"""The line a run prints when its first step is still compiling after `SLOW_COMPILE_S` seconds: it says
beforehand what XLA's "Very slow compile?" banner (stderr, at 2 minutes of one compile) means."""

from qkvflow.training import loop
from tests.timescale import limit


def test_a_slow_first_step_says_what_xlas_banner_means(capsys):
    assert loop.SLOW_COMPILE_S == 90.0  # before XLA's 2 minutes
    note = loop.slow_compile_note(0.05)
    note.join(limit(30))
    assert capsys.readouterr().out == (
        "still compiling after 0 s (a loaded machine or a large model). XLA may print a 'Very slow compile?' "
        "banner on stderr: it means only that, not an error; the run goes on\n"
    )


def test_a_first_step_done_in_time_prints_nothing(capsys):
    note = loop.slow_compile_note(0.5)
    note.cancel()  # as the loop does at the first step
    note.join(limit(30))
    assert capsys.readouterr().out == ""
