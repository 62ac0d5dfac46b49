"""scripts/numa/disable-numa-balancing.sh with a fake balancing file: the value is 0 while the command runs and
comes back after a normal exit, a failure, SIGINT, SIGTERM, SIGHUP, overlapping runs and killed runs; without
permission the command runs unchanged. Real processes and real signals throughout."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import termios
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "numa" / "disable-numa-balancing.sh"

# A command that records what it saw, then waits for a signal and exits with its own code for it
# (TERM -> 7, INT -> 8, HUP -> 9), so the tests can tell that the command got the signal and that the wrapper
# returned the command's status.
CHILD = r"""
d=$1
got=
on() { echo "$1" >> "$d/signals"; got=$1; }
trap 'on TERM' TERM; trap 'on INT' INT; trap 'on HUP' HUP
cat "$NUMA_BALANCING_FILE" > "$d/seen"
echo $$ > "$d/pid.tmp"; mv "$d/pid.tmp" "$d/pid"
while [ -z "$got" ]; do sleep 0.05; done
sleep "${LINGER:-0}"
case $got in TERM) exit 7;; INT) exit 8;; HUP) exit 9;; esac
"""


class Balancing:
    def __init__(self, tmp: Path, value: str = "1"):
        self.file = tmp / "numa_balancing"
        self.file.write_text(value + "\n")
        self.state = tmp / "state"
        self.key = str(self.file).replace("/", "_")
        self.env = {**os.environ, "NUMA_BALANCING_FILE": str(self.file), "NUMA_BALANCING_STATE_DIR": str(self.state)}
        self.tmp = tmp
        self.children: list[Child] = []

    @property
    def value(self) -> str:
        return self.file.read_text().strip()

    @property
    def saved(self) -> Path:
        return self.state / f"{self.key}.saved"

    def holders(self) -> list[str]:
        d = self.state / f"{self.key}.holders"
        return sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.is_dir() else []

    def run(self, *cmd, timeout=60, prefix=(), **kw) -> subprocess.CompletedProcess:
        return subprocess.run([*prefix, str(SCRIPT), *cmd], env=self.env, capture_output=True, text=True,
                              timeout=timeout, **kw)

    def start_child(self, name: str, linger: float = 0.0) -> "Child":
        # preexec: a signal ignored when bash starts cannot be trapped (bash manual), and a run under `nohup`
        # (as CI may be) hands SIGHUP down ignored: give the wrapper default dispositions as a shell would
        d = self.tmp / name
        d.mkdir()
        p = subprocess.Popen([str(SCRIPT), "bash", "-c", CHILD, "child", str(d)],
                             env={**self.env, "LINGER": str(linger)}, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=default_signals)
        self.children.append(Child(p, d))
        return self.children[-1]


def default_signals() -> None:
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


class Child:
    def __init__(self, popen: subprocess.Popen, d: Path):
        self.p, self.d = popen, d
        deadline = time.monotonic() + 20
        while not (d / "pid").exists():
            if popen.poll() is not None or time.monotonic() > deadline:
                popen.kill()
                raise AssertionError(f"the command did not start: {popen.communicate()}")
            time.sleep(0.02)
        self.pid = int((d / "pid").read_text())

    @property
    def seen(self) -> str:
        return (self.d / "seen").read_text().strip()

    @property
    def signals(self) -> list[str]:
        f = self.d / "signals"
        return f.read_text().split() if f.exists() else []

    def wait(self, timeout=20) -> int:
        return self.p.wait(timeout=timeout)

    def kill_all(self):
        for pid in (self.p.pid, self.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.p.wait()


@pytest.fixture
def bal(tmp_path):
    b = Balancing(tmp_path)
    yield b
    for c in b.children:                          # nothing outlives a test, even a failed one
        c.kill_all()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout=10.0):
    deadline = time.monotonic() + timeout
    while _alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        time.sleep(0.02)


# --- exit paths ----------------------------------------------------------------------------------------------

def test_normal_exit_restores(bal):
    r = bal.run("bash", "-c", 'echo "inside=$(cat "$NUMA_BALANCING_FILE")"')
    assert r.returncode == 0, r.stderr
    assert r.stdout == "inside=0\n"
    assert r.stderr == ""
    assert bal.value == "1"
    assert not bal.saved.exists() and bal.holders() == []


def test_failure_exit_status_is_returned_and_value_restored(bal):
    r = bal.run("--", "bash", "-c", 'cat "$NUMA_BALANCING_FILE"; exit 5')
    assert (r.returncode, r.stdout) == (5, "0\n")
    assert bal.value == "1"


def test_missing_command_restores(bal):
    r = bal.run(str(bal.tmp / "no-such-program"))
    assert r.returncode == 127
    assert bal.value == "1"


def test_exact_value_is_restored(tmp_path):
    b = Balancing(tmp_path, value="2")               # memory-tiering mode, not just "on"
    r = b.run("bash", "-c", 'cat "$NUMA_BALANCING_FILE"')
    assert r.stdout == "0\n"
    assert b.value == "2"


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 7), (signal.SIGINT, 8), (signal.SIGHUP, 9)])
def test_signal_is_forwarded_once_and_value_restored(bal, sig, code):
    c = bal.start_child("c")
    assert c.seen == "0" and bal.value == "0"
    os.kill(c.p.pid, sig)                         # to the wrapper only
    assert c.wait() == code                       # the command's own status for that signal
    assert c.signals == [sig.name[3:]]
    assert bal.value == "1"
    assert not bal.saved.exists() and bal.holders() == []


def test_command_killed_by_signal_gives_128_plus_n(bal):
    p = subprocess.Popen([str(SCRIPT), "sleep", "30"], env=bal.env, start_new_session=True)
    deadline = time.monotonic() + 10
    while bal.value != "0" or len(bal.holders()) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.2)
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(timeout=20) == 128 + 15
    assert bal.value == "1"


# --- several runs at once ------------------------------------------------------------------------------------

def test_overlapping_runs_restore_when_the_last_one_ends(bal):
    a = bal.start_child("a")
    b = bal.start_child("b")
    assert (a.seen, b.seen, bal.value) == ("0", "0", "0")
    assert len(bal.holders()) == 2
    os.kill(a.p.pid, signal.SIGTERM)
    assert a.wait() == 7
    assert bal.value == "0", "restored while another run still needs it off"
    assert bal.saved.read_text().strip() == "1"
    os.kill(b.p.pid, signal.SIGTERM)
    assert b.wait() == 7
    assert bal.value == "1"
    assert not bal.saved.exists() and bal.holders() == []


def test_second_run_started_while_first_holds_zero_does_not_restore_zero(bal):
    """B starts when the value is already 0 because of A: B must register, not treat 0 as the original."""
    a = bal.start_child("a")
    r = bal.run("bash", "-c", 'cat "$NUMA_BALANCING_FILE"')
    assert r.stdout == "0\n"
    assert bal.value == "0"                       # A still runs
    os.kill(a.p.pid, signal.SIGTERM)
    assert a.wait() == 7
    assert bal.value == "1"


def test_killed_run_is_restored_by_cleanup(bal):
    a = bal.start_child("a")
    a.kill_all()                                  # SIGKILL: no trap can run
    _wait_gone(a.pid)
    assert bal.value == "0"
    r = bal.run("--status")
    assert r.stdout.split()[1:4] == ["value=0", "saved=1", "holders=0"]
    r = bal.run("--cleanup")
    assert r.returncode == 0, r.stderr
    assert bal.value == "1"
    assert not bal.saved.exists() and bal.holders() == []


def test_next_run_after_a_killed_run_restores_the_real_original(bal):
    a = bal.start_child("a")
    a.kill_all()
    _wait_gone(a.pid)
    r = bal.run("bash", "-c", 'cat "$NUMA_BALANCING_FILE"')
    assert r.stdout == "0\n"
    assert bal.value == "1"                       # not the 0 the killed run left behind


def test_holder_stays_live_while_its_command_runs(bal):
    """The wrapper is SIGKILLed but its command lives on: the setting must stay 0 for it."""
    a = bal.start_child("a")
    os.kill(a.p.pid, signal.SIGKILL)              # the wrapper only
    a.p.wait()
    assert _alive(a.pid)
    r = bal.run("bash", "-c", "true")             # another run comes and goes
    assert r.returncode == 0
    assert bal.value == "0"
    assert bal.run("--cleanup").returncode == 0
    assert bal.value == "0"                       # the orphaned command still runs
    os.kill(a.pid, signal.SIGKILL)
    _wait_gone(a.pid)
    assert bal.run("--cleanup").returncode == 0
    assert bal.value == "1"


# --- nothing to do / not allowed -----------------------------------------------------------------------------

def test_already_zero_changes_nothing_and_execs(tmp_path):
    b = Balancing(tmp_path, value="0")
    p = subprocess.Popen([str(SCRIPT), "sleep", "30"], env=b.env, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{p.pid}/comm").read_text().strip() != "sleep":
            assert time.monotonic() < deadline, "the wrapper did not exec the command"
            time.sleep(0.02)
        assert b.holders() == [] and not b.saved.exists()
    finally:
        p.kill()
        p.wait()
    assert b.value == "0"


def test_without_permission_runs_the_command_unchanged(bal):
    bal.file.chmod(0o444)
    # root ignores file modes: drop the capabilities that let it (as a non-root user would lack them)
    prefix = (["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"] if os.geteuid() == 0 else [])
    r = bal.run("bash", "-c", 'echo "inside=$(cat "$NUMA_BALANCING_FILE")"; exit 3', prefix=prefix)
    assert r.returncode == 3
    assert r.stdout == "inside=1\n"
    assert r.stderr.strip() == (f"disable-numa-balancing.sh: cannot write {bal.file} (Permission denied): "
                                "running the command with NUMA balancing unchanged (1)")
    assert bal.value == "1"
    assert not bal.saved.exists() and bal.holders() == []


def test_unexpected_content_runs_unchanged(tmp_path):
    b = Balancing(tmp_path, value="on")
    r = b.run("bash", "-c", "echo ran")
    assert (r.returncode, r.stdout) == (0, "ran\n")
    assert "unexpected content 'on'" in r.stderr
    assert b.value == "on"


def test_usage(bal):
    r = bal.run("--help")
    assert r.returncode == 0 and "NUMA_BALANCING_FILE" in r.stdout and "flock" in r.stdout
    r = bal.run()
    assert r.returncode == 2 and r.stderr.startswith("disable-numa-balancing.sh: no command given")
    assert bal.value == "1"


# --- Ctrl-C in a terminal ------------------------------------------------------------------------------------

def test_ctrl_c_in_a_terminal_reaches_the_command_once(bal):
    """Ctrl-C signals the whole foreground group; the wrapper must not send a second SIGINT (llama-server
    exits at once on a second one)."""
    d = bal.tmp / "tty"
    d.mkdir()
    master, slave = os.openpty()

    def make_controlling_terminal():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    p = subprocess.Popen([str(SCRIPT), "bash", "-c", CHILD, "child", str(d)], env={**bal.env, "LINGER": "0.5"},
                         stdin=slave, stdout=slave, stderr=slave, preexec_fn=make_controlling_terminal)
    os.close(slave)
    try:
        deadline = time.monotonic() + 20
        while not (d / "pid").exists():
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.02)
        assert bal.value == "0"
        os.write(master, b"\x03")                 # the terminal's interrupt character
        assert p.wait(timeout=20) == 8
        assert (d / "signals").read_text().split() == ["INT"]
        assert bal.value == "1"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
