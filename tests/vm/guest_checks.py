"""Checks run inside the two-node guest (tests/vm/numa_guest.py); each prints one JSON document on its last line.

    python tests/vm/guest_checks.py locations          # where orchestrator finds its cache, state and llama-server
    python tests/vm/guest_checks.py balancing          # the balancing wrapper on the real /proc file
    python tests/vm/guest_checks.py bind-socket        # numactl-bind-socket.sh --socket 1 on a real process
    python tests/vm/guest_checks.py workers TOPOLOGY MODEL [FLAG...]   # the plan's workers, started as `up` does
    python tests/vm/guest_checks.py up [--out DIR] TOPOLOGY MODEL [KEY=VALUE...]  # the whole `up`, then Ctrl-C

They report what the kernel shows (``/proc/sys/kernel/numa_balancing``, every thread's ``Cpus_allowed_list``,
the memory policy and the pages' nodes in ``/proc/PID/numa_maps``); the tests on the host compare that with what
was asked. Standard library only, except ``workers``, which plans and launches with orchestrator itself.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BALANCING = Path("/proc/sys/kernel/numa_balancing")
WRAPPER = REPO / "scripts" / "numa" / "disable-numa-balancing.sh"
BIND = REPO / "scripts" / "numa" / "numactl-bind-socket.sh"
MIB = 1 << 20

# A process that touches TOUCH_MIB of anonymous memory from its main thread and from a second thread, then
# reports its threads' CPUs and waits: what numactl's binding does to a real process.
TOUCHER = r"""
import mmap, os, sys, threading
n = int(sys.argv[1]) << 20
a = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)   # private anonymous memory (shared would be shmem)
a.write(b"x" * n)
done = threading.Event()
def other():
    b = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE)
    b.write(b"y" * (1 << 20))
    done.set()
    threading.Event().wait()
threading.Thread(target=other, daemon=True).start()
done.wait()
print(hex(id(a)), flush=True)
sys.stdin.read()
"""


def read(path: Path | str) -> str:
    return Path(path).read_text().strip()


def threads(pid: int) -> dict[str, str]:
    """Every thread of ``pid``: its Cpus_allowed_list."""
    out = {}
    for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: int(p.name)):
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        m = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M)
        out[task.name] = m.group(1) if m else "?"
    return out


def numa_maps(pid: int, min_kib: int = 1024) -> list[dict]:
    """The mappings of ``pid`` with at least ``min_kib`` resident: address, policy, pages per node, kind."""
    out = []
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        words = line.split()
        nodes = {int(w[1:w.index("=")]): int(w.split("=")[1]) for w in words if re.match(r"^N\d+=\d+$", w)}
        psize = next((int(w.split("=")[1]) for w in words if w.startswith("kernelpagesize_kB=")), 4)
        if sum(nodes.values()) * psize < min_kib:
            continue
        kind = ("anon" if "anon=" in line else "file") + (" heap" if "heap" in words else "")
        path = next((w.split("=", 1)[1] for w in words if w.startswith("file=")), "")
        out.append({"addr": words[0], "policy": words[1], "pages": nodes, "kind": kind, "file": path})
    return out


def mempolicy(pid: int) -> str:
    """The task policy as numa_maps shows it for a fresh anonymous region (the stack's line: its default)."""
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        if "stack" in line.split():
            return line.split()[1]
    return "?"


# -- balancing ---------------------------------------------------------------------------------------------------

def _wait_for(pred, timeout=60.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError(what)


def _holder(ready: Path, extra: str = "") -> subprocess.Popen:
    """The wrapper around a shell that writes what it saw, then waits for a signal (exit 7 on TERM, 8 on INT)."""
    script = (f"trap 'exit 7' TERM; trap 'exit 8' INT; cat {BALANCING} > {ready}.tmp; mv {ready}.tmp {ready}; "
              f"{extra} while :; do sleep 0.1; done")
    return subprocess.Popen([str(WRAPPER), "bash", "-c", script], start_new_session=True)


def _progress(what: str, t0: float) -> None:
    """One line on stderr per step, so that a check cut short by the host's deadline shows how far it got."""
    print(f"guest_checks: {what} at {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)


def balancing() -> dict:
    t0 = time.monotonic()
    res: dict = {"start": read(BALANCING), "dev_fd": os.path.exists("/dev/fd")}
    tmp = Path("/run/balancing-check")
    tmp.mkdir(exist_ok=True)

    def one(name: str, how: str, start: str = "1") -> None:
        BALANCING.write_text(start + "\n")
        ready = tmp / name
        p = _holder(ready)
        _wait_for(ready.exists, what=f"{name}: the command did not start")
        during = read(ready)
        if how == "SIGKILL":                  # the wrapper and its command killed: --cleanup restores
            os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait(60)
            subprocess.run([str(WRAPPER), "--cleanup"], capture_output=True, check=False, timeout=120)
        else:
            p.send_signal(getattr(signal, how))
            rc = p.wait(60)
        res[name] = {"during": during, "after": read(BALANCING), "rc": rc}
        _progress(name, t0)

    def plain(name: str, code: int) -> None:   # a command that ends by itself, with status ``code``
        BALANCING.write_text("1\n")
        r = subprocess.run([str(WRAPPER), "bash", "-c", f"cat {BALANCING}; exit {code}"], capture_output=True,
                           text=True, timeout=120)
        res[name] = {"during": r.stdout.strip(), "after": read(BALANCING), "rc": r.returncode,
                     "stderr": r.stderr.strip()}
        _progress(name, t0)

    plain("exit", 0)
    plain("failure", 3)
    one("sigint", "SIGINT")
    one("sigterm", "SIGTERM")
    one("killed", "SIGKILL")
    for start in ("0", "2"):
        one(f"start{start}", "SIGTERM", start=start)
    # two holders: the setting comes back only when the second one leaves
    BALANCING.write_text("1\n")
    a, b = _holder(tmp / "a"), _holder(tmp / "b")
    _wait_for(lambda: (tmp / "a").exists() and (tmp / "b").exists(), what="two holders")
    a.send_signal(signal.SIGTERM)
    a.wait(60)
    after_first = read(BALANCING)
    b.send_signal(signal.SIGTERM)
    b.wait(60)
    res["two_holders"] = {"during": [read(tmp / "a"), read(tmp / "b")], "after_first": after_first,
                          "after_both": read(BALANCING)}
    _progress("two holders", t0)
    BALANCING.write_text(res["start"] + "\n")
    res["seconds"] = round(time.monotonic() - t0, 1)
    return res


# -- numactl-bind-socket.sh --------------------------------------------------------------------------------------

def bind_socket(touch_mib: int = 64) -> dict:
    res = {}
    for interleave in ("off", "on"):
        argv = [str(BIND), "--socket", "1", "--mode", "physical", "--interleave", interleave, "--",
                sys.executable, "-c", TOUCHER, str(touch_mib)]
        dry = subprocess.run(argv[:7] + ["--dry-run"] + argv[7:], capture_output=True, text=True, timeout=120)
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        p.stdout.readline()                 # touched
        maps = [m for m in numa_maps(p.pid) if m["kind"].startswith("anon")]
        biggest = max(maps, key=lambda m: sum(m["pages"].values()))
        res[interleave] = {"maps": maps, "dry_run": dry.stdout.strip(), "threads": threads(p.pid),
                           "policy": mempolicy(p.pid), "touched": biggest}
        p.stdin.close()
        p.wait(60)
    return res


# -- the plan's workers ------------------------------------------------------------------------------------------

def workers(topology: str, model: str, *extra: str, prompt: str = "Hello") -> dict:
    """``extra``: flags appended to each llama-server's argv, for a control run (``--numa numactl`` shows the
    binding that the plan avoids leaking)."""
    import dataclasses
    import urllib.request

    from orchestrator.launch import process
    from orchestrator.resolve import resolve

    res = resolve(Path(topology), overrides={"model.path": model})
    out = {"workers": []}
    logs = Path("/run/worker-logs")
    logs.mkdir(exist_ok=True)
    started = []
    try:
        for w, spec in zip(res.plan.workers, res.specs):
            if extra:
                spec = dataclasses.replace(spec, argv=tuple(spec.argv) + tuple(extra))
            t0 = time.monotonic()
            proc = process.start(spec, logs / f"{w.name}.log")
            started.append(proc)
            started_s = time.monotonic() - t0
            entry = {"name": w.name, "argv": list(spec.argv), "plan": w.numa.to_dict(), "start_s": started_s}
            out["workers"].append(entry)
        for proc, entry, w in zip(started, out["workers"], res.plan.workers):
            t0 = time.monotonic()
            proc.wait_healthy(900)
            entry["ready_s"] = time.monotonic() - t0
            server = _server_pid(proc.pid)
            entry["threads"] = threads(server)
            entry["policy"] = mempolicy(server)
            entry["maps"] = numa_maps(server)
            body = json.dumps({"prompt": prompt, "n_predict": 8}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{w.port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
            t0 = time.monotonic()
            with urllib.request.urlopen(req, timeout=600) as r:
                answer = json.loads(r.read())
            entry["completion"] = {"content": answer.get("content", ""),
                                   "tokens_predicted": answer.get("tokens_predicted"),
                                   "seconds": round(time.monotonic() - t0, 1)}
            entry["threads_after"] = threads(server)      # after computing: llama.cpp must not have widened them
        out["balancing_during"] = read(BALANCING)
    finally:
        for proc in started:
            proc.stop()
    out["balancing_after"] = read(BALANCING)
    return out


def up(topology: str, model: str, *sets: str, out_dir: str = "/run", ready_timeout: str = "1500") -> dict:
    """``orchestrator up`` in the foreground, as a user runs it: a completion through the gateway, then Ctrl-C
    (SIGINT to its process group, as a terminal sends it) must leave no llama-server or Ray process behind and
    NUMA balancing as it was. While it serves, each llama-server's binding as the kernel shows it: the wrapper
    and numactl arguments it was started with, every thread's CPUs, its memory policy and its pages' nodes.
    ``out_dir`` receives up's log, ``orchestrator status`` and this report (``--out`` of numa_guest.py makes it
    a host folder)."""
    import urllib.request

    dest = Path(out_dir)
    dest.mkdir(parents=True, exist_ok=True)
    out: dict = {"balancing_before": read(BALANCING)}
    t0 = time.monotonic()
    log_path = dest / "up.log"
    log = open(log_path, "wb")
    orch = str(REPO / ".venv" / "bin" / "orchestrator")
    port = next((kv.split("=", 1)[1] for kv in sets if kv.startswith("gateway.port=")), "8080")
    p = subprocess.Popen([orch, "up", topology, "--set", f"model.path={model}",
                          *[a for kv in sets for a in ("--set", kv)], "--ready-timeout", ready_timeout],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        body = json.dumps({"model": "demo-moe", "max_tokens": 8,
                           "messages": [{"role": "user", "content": "Hello"}]}).encode()
        answer = None
        while answer is None:
            if p.poll() is not None:            # up gave up: still report what it left behind
                out["error"] = read(log_path)[-2000:]
                break
            seen = out.setdefault("first_seen_s", {})     # where the start-up time goes, failed or not
            for pid in _ours():
                seen.setdefault(_name(pid), round(time.monotonic() - t0, 1))
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=600) as r:
                    answer = json.loads(r.read())
            except OSError:
                time.sleep(5)
        if answer is not None:
            out["ready_s"] = round(time.monotonic() - t0, 1)
            out["completion"] = {"content": answer["choices"][0]["message"].get("content", ""),
                                 "usage": answer.get("usage", {})}
            out["balancing_during"] = read(BALANCING)
            out["servers"] = [_server_report(pid) for pid in _servers()]
            st = subprocess.run([orch, "status"], capture_output=True, text=True, timeout=600)
            (dest / "status.txt").write_text(st.stdout + st.stderr)
            out["status_rc"] = st.returncode
            out["running"] = sorted({_comm(pid) for pid in _ours()})
    finally:
        t1 = time.monotonic()
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
        out["up_rc"] = p.wait(900)
        out["stop_s"] = round(time.monotonic() - t1, 1)
    time.sleep(2)
    out["left"] = sorted({f"{pid} {_comm(pid)}" for pid in _ours()})
    out["balancing_after"] = read(BALANCING)
    _keep_logs(dest / "logs")
    (dest / "report.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def _name(pid: int) -> str:
    """A process's short name; Ray's Python processes by their script (dashboard.py, agent.py...)."""
    comm = _comm(pid)
    if comm.startswith("python"):
        script = next((a for a in _cmdline(pid)[1:] if a.endswith(".py") or a.startswith("orchestrator.")), "")
        return Path(script).name or comm
    return comm


def _keep_logs(dest: Path, tail: int = 256 << 10) -> None:
    """orchestrator's logs and the Ray session's (the guest's files vanish with it): the last ``tail`` bytes of
    each."""
    roots = [("orchestrator", Path.home() / ".local" / "state" / "orchestrator" / "logs")]
    roots += [("ray", Path(d) / "r" / "session_latest" / "logs") for d in Path("/tmp").glob("orch-ray-*")]
    for label, root in roots:
        for f in root.rglob("*") if root.is_dir() else ():
            if not f.is_file():
                continue
            to = dest / label / f.relative_to(root)
            to.parent.mkdir(parents=True, exist_ok=True)
            with open(f, "rb") as src:
                src.seek(max(0, f.stat().st_size - tail))
                to.write_bytes(src.read())


def _servers() -> list[int]:
    return sorted(pid for pid in _pids() if _comm(pid).startswith("llama-server"))


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _server_report(pid: int) -> dict:
    """One llama-server as the kernel shows it. numactl exec'd it, so its arguments are on the parent's command
    line (the balancing wrapper's)."""
    ppid = int(re.search(r"^PPid:\s*(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))
    maps = numa_maps(pid)
    pages: dict[str, dict[str, int]] = {}
    for m in maps:
        kind = pages.setdefault(m["kind"].split()[0], {})
        for node, n in m["pages"].items():
            kind[str(node)] = kind.get(str(node), 0) + n
    argv = _cmdline(pid)
    return {"pid": pid, "parent_argv": _cmdline(ppid), "argv": argv,
            "port": argv[argv.index("--port") + 1] if "--port" in argv else None,
            "threads": threads(pid), "policy": mempolicy(pid), "pages": pages, "maps": maps}


def _ours() -> list[int]:
    """Processes of the deployment: llama-server, Ray's (its binaries and its Python processes) and
    orchestrator's, except this check and its ancestors."""
    mine, pid = set(), os.getpid()
    while pid > 1:
        mine.add(pid)
        try:
            pid = int(re.search(r"^PPid:\s*(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))
        except (OSError, AttributeError):
            break
    found = []
    for pid in _pids():
        if pid in mine:
            continue
        comm, cmd = _comm(pid), " ".join(_cmdline(pid))
        if comm.startswith(("llama-server", "raylet", "gcs_server", "ray::")) or "site-packages/ray/" in cmd \
                or "ray.scripts" in cmd or "orchestrator" in cmd:
            found.append(pid)
    return found


def _pids() -> list[int]:
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _server_pid(wrapper_pid: int) -> int:
    """The llama-server under the wrapper (the wrapper's child, numactl having exec'd it)."""
    seen = [wrapper_pid]
    while seen:
        pid = seen.pop(0)
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip().startswith("llama-server"):
                return pid
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        seen.extend(int(k) for k in kids)
    raise RuntimeError(f"no llama-server under pid {wrapper_pid}")


def locations() -> dict:
    """Where orchestrator, run in the guest, looks for the user's files and which llama-server it finds."""
    from orchestrator.backend.detect import BackendError, find_llama_server
    from orchestrator.paths import cache_dir, state_dir

    try:
        server = list(find_llama_server())
    except BackendError as e:
        server = ["", str(e)]
    return {"home": os.environ.get("HOME"), "cache": str(cache_dir()), "state": str(state_dir()), "server": server}


def main(argv: list[str]) -> int:
    what, *rest = argv
    kw = {}
    if what == "up" and rest[:1] == ["--out"]:
        kw["out_dir"], rest = rest[1], rest[2:]
    doc = {"locations": locations, "balancing": balancing, "bind-socket": bind_socket, "workers": workers, "up": up}[what](*rest, **kw)
    print(json.dumps(doc))
    return 1 if doc.get("error") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
