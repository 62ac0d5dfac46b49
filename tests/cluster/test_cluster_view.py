"""Pure parts: deployment validation, binding/devices read back from argv, the status table, the state file, and
the rule that only ray_api.py imports Ray."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from orchestrator.cluster import state as statemod
from orchestrator.cluster.deployment import Deployment, RestartPolicy
from orchestrator.cluster.view import HEADER, describe_binding, describe_devices, format_status, format_table, worker_rows
from orchestrator.errors import ConfigError
from orchestrator.launch.spec import LaunchSpec

PKG = Path(__file__).resolve().parents[2] / "orchestrator" / "cluster"


def spec(name="w0", port=9000, node=None, argv=("llama-server",)):
    return LaunchSpec(name=name, argv=argv, port=port, node=node)


# --- binding and devices ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,expected", [
    (("llama-server", "-m", "x"), "-"),
    (("numactl", "--cpunodebind=0", "--membind=0", "--", "llama-server", "--numa", "numactl", "-t", "32"),
     "numactl --cpunodebind=0 --membind=0, --numa numactl, -t 32"),
    (("numactl", "--interleave=all", "llama-server", "--numa", "distribute"),
     "numactl --interleave=all, --numa distribute"),
    (("numactl", "-N", "1", "-m", "1", "llama-server"), "numactl -N 1 -m 1"),
    (("/opt/o/scripts/numa/disable-numa-balancing.sh", "/opt/o/scripts/numa/numactl-bind-socket.sh", "--socket",
      "1", "--mode", "physical", "--interleave", "on", "--", "/b/llama-server", "-t", "48"),
     "numa-balancing off, socket --socket 1 --mode physical --interleave on, -t 48"),
])
def test_describe_binding_of_a_hand_written_argv(argv, expected):
    assert describe_binding(spec(argv=argv)) == expected


def test_describe_devices_of_a_hand_written_argv():
    def devices(env, argv):
        return describe_devices(LaunchSpec(name="w", argv=argv, env=env))

    assert devices({"CUDA_VISIBLE_DEVICES": "0,1"}, ("llama-server", "-sm", "layer", "-ngl", "99")) == \
        "cuda:0,1, -sm layer, -ngl 99"
    assert devices({"CUDA_VISIBLE_DEVICES": ""}, ("llama-server",)) == "cpu"
    assert devices({}, ("llama-server",)) == "-"


def test_status_of_a_planned_worker_shows_its_settings_not_its_argv():
    """The binding and devices come from the settings stored with the spec: the argv is not read back."""
    from orchestrator.backend.info import nominal_backend
    from orchestrator.launch import spec_for_worker
    from orchestrator.launch.numa import NumaPolicy
    from orchestrator.launch.settings import WorkerSettings

    s = WorkerSettings(model_path="m.gguf", host="127.0.0.1", port=9000, gpus=(2, 3), n_gpu_layers=999,
                       split_mode="layer", tensor_split=(30, 31), main_gpu=0,
                       numa=NumaPolicy.bind([1], cpus=[16, 17, 18, 19]), numa_flag="numactl",
                       disable_numa_balancing=True, threads=4, threads_batch=8)
    planned = spec_for_worker("w0", s, nominal_backend("mainline", cuda=True))
    assert describe_binding(planned) == "numa-balancing off, bind cpus 16-19 mem 1, --numa numactl, -t 4 -tb 8"
    assert describe_devices(planned) == "cuda:2,3, -ngl 999, -sm layer, -ts 30,31, -mg 0"
    # the same spec after a JSON round trip (how the controller and its workers receive it)
    again = LaunchSpec.from_dict(json.loads(json.dumps(planned.to_dict())))
    assert describe_binding(again) == describe_binding(planned) and describe_devices(again) == describe_devices(planned)
    cpu = spec_for_worker("w1", WorkerSettings(model_path="m", gpus=(), threads=2), nominal_backend("mainline", False))
    assert (describe_binding(cpu), describe_devices(cpu)) == ("-t 2", "cpu")


def test_status_table_and_text():
    workers = [{"name": "w0", "state": "ready", "pid": 11, "node": "a", "binding": "numactl -N 0", "devices": "cuda:0",
                "restarts": 1, "last_error": "killed by SIGKILL",
                "metrics": {"rss_bytes": 3 * 2**30, "prompt_tps": 812.4, "generation_tps": 23.46,
                            "gpus": [{"worker_vram": 20 * 2**30}]}},
               {"name": "w1", "state": "failed", "pid": None, "node": "b", "restarts": 5,
                "reason": "gave up after 5 restart(s)", "metrics": {}}]
    rows = worker_rows(workers)
    assert rows[0] == ["w0", "ready", "11", "a", "numactl -N 0", "cuda:0", "3.0 GiB +20.0 GiB vram", "812/23.5", "-",
                       "-", "1", "killed by SIGKILL"]
    assert rows[1][1:3] == ["failed", "-"] and rows[1][7] == "-" and rows[1][-1] == "gave up after 5 restart(s)"
    text = format_table(rows)
    assert text.splitlines()[0].split()[:3] == HEADER[:3] and len(text.splitlines()) == 3
    full = format_status({"namespace": "ns", "phase": "degraded", "error": "w1: failed", "workers": workers,
                          "gateway": {"url": "http://127.0.0.1:8080", "state": "serving", "healthy": 1},
                          "dashboard_url": "http://127.0.0.1:8265"})
    assert "deployment ns: degraded (w1: failed)" in full and "healthy replicas: 1/2" in full and "8265" in full
    assert "last 5 minutes" not in full                  # no stream seen: no latency note


def test_status_shows_the_gateways_recent_latency_per_worker():
    from orchestrator.cluster.latency import recent_from_page

    # two gateway processes (two WorkerIds) of one deployment, as Ray's endpoint shows them
    def series(name, worker_id, replica, counts):
        return "".join(f'ray_{name}{{Component="core_worker",WorkerId="{worker_id}",le="{le}",replica="{replica}"}} '
                       f"{n}\n" for le, n in counts)
    page = ("# HELP ray_orchestrator_gateway_recent_time_to_first_token ...\n"
            + series("orchestrator_gateway_recent_time_to_first_token", "a1", "w0",
                     [("0.03", 0), ("0.05", 6), ("0.1", 9), ("+Inf", 10)])
            + series("orchestrator_gateway_recent_time_to_first_token", "b2", "w0",
                     [("0.03", 0), ("0.05", 4), ("0.1", 10), ("+Inf", 10)])
            + series("orchestrator_gateway_recent_stream_tokens_per_second", "a1", "w0",
                     [("20.0", 0), ("30.0", 10), ("+Inf", 10)])
            + series("orchestrator_gateway_recent_time_to_first_token", "a1", "w1", [("0.05", 0), ("+Inf", 0)])
            + 'ray_orchestrator_gateway_requests_total{code="200",model="m"} 20.0\n')
    recent = recent_from_page(page)
    assert recent["w0"]["streams"] == 20
    assert recent["w0"]["ttft_p50_s"] == pytest.approx(0.03 + 0.02 * 10 / 10)      # 10 of 20 at or under 50 ms
    assert recent["w0"]["ttft_p95_s"] == pytest.approx(0.05 + 0.05 * (19 - 10) / 9)
    assert recent["w0"]["tokens_per_s_p50"] == pytest.approx(25.0)
    assert recent["w1"]["streams"] == 0 and recent["w1"]["ttft_p50_s"] is None
    workers = [{"name": "w0", "state": "ready", "metrics": {}, "latency": recent["w0"]},
               {"name": "w1", "state": "ready", "metrics": {}, "latency": recent["w1"]}]
    rows = worker_rows(workers)
    assert rows[0][8:10] == ["50/100 ms", "25.0"] and rows[1][8:10] == ["-", "-"]
    text = format_status({"namespace": "ns", "phase": "ready", "workers": workers, "gateway": {}})
    assert "ttft p50/p95" in text.splitlines()[3] and "last 5 minutes" in text
    assert "unknown: no metrics endpoint" in format_status({"workers": workers, "gateway": {},
                                                            "latency_error": "no metrics endpoint"})


# --- deployment ----------------------------------------------------------------------------------------------------
def test_deployment_round_trips():
    d = Deployment(specs=(spec("a", 9000), spec("b", 9001, node="n2")), api_key_env="KEY", ray_address="h:6379",
                   restart=RestartPolicy(max_restarts=2), plan_json={"x": 1})
    assert Deployment.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    assert not d.embedded and Deployment(specs=(spec(),)).embedded


@pytest.mark.parametrize("kw,msg", [
    ({"specs": ()}, "no workers"),
    ({"specs": (spec("a"), spec("a", 9001))}, "'a': the name is used by more than one worker"),
    ({"specs": (spec("a"), spec("b"))}, "127.0.0.1:9000 on this node is already used by worker 'a'"),
    ({"specs": (spec("a b"),)}, "not a valid worker name"),
    ({"specs": (spec(),), "gateway_port": 70000}, "gateway.port: 70000"),
    ({"specs": (spec(),), "api_key_env": "1BAD"}, "gateway.api_key_env"),
    ({"specs": (spec(),), "namespace": "a/b"}, "ray.namespace"),
    ({"specs": (spec(),), "gateway_processes": 0}, "gateway.processes: 0 is not in 1..64"),
])
def test_deployment_rejects(kw, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        Deployment(**kw)


def test_gateway_processes_auto_is_one_a_number_is_kept():
    from orchestrator.cluster.deployment import gateway_processes

    assert gateway_processes("auto") == 1 and gateway_processes(None) == 1
    assert gateway_processes(3) == 3
    d = Deployment(specs=(spec(),), gateway_processes=2)
    assert Deployment.from_dict(json.loads(json.dumps(d.to_dict()))).gateway_processes == 2


def test_same_port_on_two_nodes_is_fine():
    Deployment(specs=(spec("a", 9000, node="n1"), spec("b", 9000, node="n2")))


def test_restart_policy_bounds_and_backoff():
    p = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=4)
    assert [p.backoff(k) for k in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    with pytest.raises(ConfigError, match="restart.max_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ConfigError, match="backoff_max_s"):
        RestartPolicy(backoff_initial_s=5, backoff_max_s=1)


# --- state file ----------------------------------------------------------------------------------------------------
def test_state_file_round_trip_and_atomic_write(state_home):
    st = statemod.ClusterState(namespace="ns", ray_address="127.0.0.1:1", embedded=True, up_pid=1, started_at=2.0,
                               head_pid=3, workers=[{"name": "w0"}])
    path = statemod.write(st)
    assert path == state_home / "cluster" / "ns.json"
    assert statemod.read("ns") == st and statemod.recorded() == ["ns"]
    assert [p.name for p in path.parent.iterdir()] == ["ns.json"]        # no temp file left behind
    statemod.remove("ns")
    assert statemod.read("ns") is None and statemod.recorded() == []


# --- the Ray boundary ------------------------------------------------------------------------------------------------
def test_only_ray_api_imports_ray():
    offenders = []
    for py in sorted(PKG.glob("*.py")):
        tree = ast.parse(py.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "ray" or n.startswith("ray.") for n in names) and py.name != "ray_api.py":
                offenders.append(f"{py.name}:{node.lineno}")
    assert offenders == []


def test_ray_api_imports_ray_lazily():
    tree = ast.parse((PKG / "ray_api.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any(getattr(n, "module", None) == "ray" or any(a.name == "ray" for a in getattr(n, "names", []))
                   for n in top)


def test_a_driver_reuses_its_connection_only_to_the_same_endpoint():
    from orchestrator.cluster.ray_api import _same_endpoint

    assert _same_endpoint("127.0.0.1:6379", "localhost:6379")
    assert not _same_endpoint("127.0.0.1:6379", "127.0.0.1:6380")
    assert not _same_endpoint("10.0.0.1:6379", "10.0.0.2:6379")


def test_status_reads_the_latency_from_a_real_metrics_endpoint_or_says_why_not():
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from orchestrator.commands.status import add_recent_latency

    page = ('ray_orchestrator_gateway_recent_time_to_first_token{WorkerId="a",le="0.05",replica="w0"} 3.0\n'
            'ray_orchestrator_gateway_recent_time_to_first_token{WorkerId="a",le="+Inf",replica="w0"} 4.0\n').encode()

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        st = {"metrics_url": f"http://127.0.0.1:{server.server_address[1]}/metrics",
              "workers": [{"name": "w0"}, {"name": "w1"}]}
        add_recent_latency(st)
        assert "latency_error" not in st and st["workers"][0]["latency"]["streams"] == 4.0
        assert st["workers"][1]["latency"] == {}
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:                     # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    st = {"metrics_url": f"http://127.0.0.1:{closed}/metrics", "workers": [{"name": "w0"}]}
    add_recent_latency(st, timeout=2)
    assert "did not answer" in st["latency_error"] and "latency" not in st["workers"][0]
    st = {"metrics_url": None, "workers": []}
    add_recent_latency(st)
    assert "no metrics endpoint recorded" in st["latency_error"]
