"""benchmarks/probes/ab_probe.py on two made-up probes: every configuration runs with each
build in turn, a configuration's KEY=VAL words reach that run's environment, and a run that
fails is shown by its exit status instead of a time."""
import stat


def _probe(path, body):
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_alternates_builds_and_reports_the_ratio(tmp_path, capsys, probe_tool):
    a = _probe(tmp_path / "a", 'echo "time: $((10 + ${EXTRA:-0} + $1)).00 us per call"')
    b = _probe(tmp_path / "b", '[ "$1" = 2 ] && exit 3; echo "time: 8.00 us, $GLOBAL"')
    assert probe_tool("ab_probe").main([a, b, "--reps", "3", "--env", "GLOBAL=1", "--", "EXTRA=5 1", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split("|")[1].split() == ["16.00"] * 3
    assert lines[1].split("|")[2].split() == ["8.00"] * 3
    assert lines[1].split("|")[3].strip() == "0.500"
    assert lines[2].split("|")[2].split() == ["rc=3"] * 3 and lines[2].split("|")[3].strip() == "-"
