import subprocess
import sys

from orchestrator.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    try:
        main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_console_script_runs():
    res = subprocess.run([sys.executable, "-m", "orchestrator", "--version"], capture_output=True, text=True)
    assert res.returncode == 0
    assert res.stdout.startswith("orchestrator ")


def test_user_error_is_one_line_exit_2(tmp_path):
    # a missing explicit llama-server is a user error: one line, exit 2, no traceback
    res = subprocess.run([sys.executable, "-m", "orchestrator", "doctor", "--binary", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert "Traceback" not in res.stderr + res.stdout
    assert res.returncode == 1  # doctor reports the missing part and fails
    assert "not found" in res.stdout
