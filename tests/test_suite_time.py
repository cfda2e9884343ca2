"""bench/suite_time.py reads pytest's own output: the closing line, the slowest durations and the
launch counts that tests/conftest.py prints; it refuses a log without a closing line."""

import pytest

LOG = """\
........                                                      [100%]
== process launches and CPU-seconds per file (torchrun / trainplan / other / CPU s) ==
  34   51    2     512  tests/run/test_fault_injection.py
   0   22    1      21  tests/test_cli.py
  34   73    3    1651  in all: 110 launches, 1651 CPU-seconds (the files under 5 CPU-s without a launch not listed)
============================= slowest 15 durations =============================
208.10s call     tests/run/test_fault_injection.py::test_kill_anywhere_then_resume_auto_is_bitwise[fsdp2]
12.00s setup    tests/run/test_accept.py::test_accept_setup
= 1747 passed, 22 skipped, 7 warnings in 908.21s (0:15:08) =
"""


def test_a_run_log_gives_its_tests_time_slowest_and_launches(bench_script):
    suite = bench_script("suite_time")
    r = suite.parse(LOG)
    assert r["tally"] == {"passed": 1747, "skipped": 22, "warnings": 7}
    assert r["seconds"] == 908.21
    assert r["slowest"][0] == (
        208.10,
        "call",
        "tests/run/test_fault_injection.py::test_kill_anywhere_then_resume_auto_is_bitwise[fsdp2]",
    )
    assert r["launches"] == {"torchrun": 34, "trainplan": 73, "other": 3, "all": 110, "cpu_s": 1651}
    text = suite.block({"test": {**r, "wall": 1000.0}}, "a test machine")
    assert "| `make test` | 1,747 / 22 | 908 s (15.1 min) | 1,000 s | 34 / 73 / 3 | 1,651 |" in text
    # a log from before the CPU-seconds column
    old = LOG.replace("    1651  in all: 110 launches, 1651 CPU-seconds", "  in all: 110 launches")
    assert suite.parse(old)["launches"] == {"torchrun": 34, "trainplan": 73, "other": 3, "all": 110, "cpu_s": None}


def test_a_log_without_a_closing_line_is_refused(bench_script):
    with pytest.raises(ValueError, match="no pytest closing line"):
        bench_script("suite_time").parse("....\nKeyboardInterrupt\n")
