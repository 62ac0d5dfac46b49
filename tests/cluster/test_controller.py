"""The controller's control logic, stepped with a fake clock and a fake Ray api (no Ray here)."""

from __future__ import annotations

import pytest

from orchestrator.cluster.controller import (
    DEGRADED, FAILED, READY, STARTING, STOPPED, Controller, NodeMissing, resolve_node,
)
from orchestrator.cluster.deployment import Deployment, RestartPolicy
from orchestrator.cluster.ray_api import ActorGone, NodeInfo, RemoteError
from orchestrator.launch.spec import LaunchSpec


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeWorker:
    def __init__(self, args, node_id) -> None:
        spec, policy, node_name, log_dir, ns, resumed, adopt, upstream_key = args
        self.upstream_key = upstream_key
        self.name, self.node_id, self.node_name, self.resumed = spec["name"], node_id, node_name, resumed
        self.adopt = adopt
        self.state = "starting"
        self.pid = 1000
        self.dead = False
        self.reason = ""
        self.stopped = False

    def status(self):
        return {"name": self.name, "state": self.state, "pid": self.pid, "restarts": 0, "reason": self.reason,
                "last_error": self.reason, "uptime_s": 0.0}

    def start(self):
        return self.status()

    def stop(self):
        self.stopped = True
        self.state = "stopped"
        return self.status()


class FakeGateway:
    def __init__(self, args, node_id) -> None:
        self.node_id = node_id
        self.tables = []
        self.fail_start = None
        self.dead = False
        self.stopped = False

    def start(self, host, port, key, table, reuse_port=False, upstream_key=None, cors_origins="localhost"):
        self.reuse_port, self.cors_origins = reuse_port, cors_origins
        if self.fail_start:
            raise RemoteError(self.fail_start)
        self.tables.append(table)
        return f"http://{host}:{port}"

    def set_replicas(self, table):
        self.tables.append(table)
        return len(self.tables)

    def stop(self):
        self.stopped = True


class Ref:
    def __init__(self, actor, method, args) -> None:
        self.actor, self.method, self.args = actor, method, args
        self.hold = False


class FakeApi:
    """The RayApi surface the controller uses; refs resolve on the next poll unless held."""

    def __init__(self, nodes) -> None:
        self._nodes = nodes
        self.actors = []
        self.killed = []
        self.gateway_fail = None
        self.hold_start = False
        self.hold_push = False
        self.nodes_error = None

    def nodes(self):
        if self.nodes_error:
            raise self.nodes_error
        return self._nodes

    def create_actor(self, cls, *args, node_id=None, resources=None, max_concurrency=None, **kw):
        if cls is FakeGateway:
            a = FakeGateway(args, node_id)
            a.fail_start = self.gateway_fail
        else:
            a = FakeWorker(args, node_id)
            a.resources = resources
        self.actors.append(a)
        return a

    def submit(self, actor, method, *args):
        r = Ref(actor, method, args)
        if method == "start" and self.hold_start and isinstance(actor, FakeWorker):
            r.hold = True
        if method == "set_replicas" and self.hold_push:
            r.hold = True
        return r

    def _resolve(self, ref):
        if ref.actor.dead:
            raise ActorGone("The actor died unexpectedly before finishing this task.")
        return getattr(ref.actor, ref.method)(*ref.args)

    def poll(self, ref):
        if ref.hold:
            return False, None
        return True, self._resolve(ref)

    def get(self, ref, timeout):
        return self._resolve(ref)

    def kill(self, actor):
        self.killed.append(actor)
        actor.dead = True


NODES = [NodeInfo("id-a", "a", "10.0.0.1", "hosta", True, True, {}),
         NodeInfo("id-b", "b", "10.0.0.2", "hostb.example", True, False, {}),
         NodeInfo("id-dead", "c", "10.0.0.3", "hostc", False, False, {})]


def spec(name, node=None, port=9000, alias="m", host=None):
    host = host or ("0.0.0.0" if node == "b" else "127.0.0.1")      # node b is another machine
    return LaunchSpec(name=name, argv=("llama-server", "--port", str(port)), port=port, node=node, model_alias=alias,
                      resources={"GPU": 1} if node == "b" else {}, host=host)


def make(specs, restarted=False, gateway_processes=1, early=None, **policy):
    dep = Deployment(specs=tuple(specs), gateway_port=8080, plan_json={"workers": len(specs)},
                     gateway_processes=gateway_processes, early=early or {},
                     restart=RestartPolicy(**{"backoff_initial_s": 1.0, "max_restarts": 2, **policy}))
    api, clock = FakeApi(NODES), Clock()
    c = Controller(dep, api, driver_node_id="id-a", clock=clock, worker_cls=FakeWorker, gateway_cls=FakeGateway,
                   restarted=restarted)
    return c, api, clock


def workers(api):
    return [a for a in api.actors if isinstance(a, FakeWorker)]


def gateway(api):
    return [a for a in api.actors if isinstance(a, FakeGateway)][-1]


def tick(c, clock, n=1, dt=0.5):
    for _ in range(n):
        clock.t += dt
        c.update()


def test_workers_are_placed_on_the_nodes_their_specs_name():
    c, api, clock = make([spec("w0", None, 9000), spec("w1", "b", 9001), spec("w2", "10.0.0.1", 9002)])
    tick(c, clock)
    ws = {w.name: w for w in workers(api)}
    assert ws["w0"].node_id == "id-a"                      # None: the node up runs on
    assert ws["w1"].node_id == "id-b" and ws["w1"].resources == {"GPU": 1}
    assert ws["w2"].node_id == "id-a"                      # by IP
    assert gateway(api).node_id == "id-a"
    urls = {r["name"]: r["url"] for r in c.replica_table()}
    assert urls == {"w0": "http://127.0.0.1:9000", "w1": "http://10.0.0.2:9001", "w2": "http://127.0.0.1:9002"}


def test_loopback_worker_on_another_machine_is_refused():
    c, api, clock = make([spec("w1", node="b", port=9001, host="127.0.0.1")])
    tick(c, clock, 2)
    assert c.phase == FAILED and "listens on 127.0.0.1 on node b (10.0.0.2), which the gateway on node a" in c.error
    assert workers(api) == []


def test_ready_when_all_workers_ready_and_gateway_serves_and_table_pushed():
    c, api, clock = make([spec("w0", port=9000), spec("w1", port=9001)])
    tick(c, clock, 3)
    assert c.phase == STARTING
    assert not any(r["healthy"] for r in c.replica_table())
    for w in workers(api):
        w.state = "ready"
    tick(c, clock, 3)
    assert c.phase == READY
    table = gateway(api).tables[-1]
    assert [(r["name"], r["url"], r["healthy"]) for r in table] == [
        ("w0", "http://127.0.0.1:9000", True), ("w1", "http://127.0.0.1:9001", True)]


def test_several_gateway_processes_share_the_port_and_all_must_route():
    c, api, clock = make([spec("w0", port=9000)], gateway_processes=3)
    tick(c, clock, 2)
    gws = [a for a in api.actors if isinstance(a, FakeGateway)]
    assert len(gws) == 3 and all(g.reuse_port and g.node_id == "id-a" for g in gws)
    workers(api)[0].state = "ready"
    api.hold_push = True                      # none has confirmed the healthy table yet
    tick(c, clock, 3)
    assert c.phase == STARTING
    c.gws[0].push_ref.hold = c.gws[1].push_ref.hold = False     # two of three confirm: still not ready
    tick(c, clock, 1)
    assert c.phase == STARTING
    c.gws[2].push_ref.hold = False
    api.hold_push = False
    tick(c, clock, 1)
    assert c.phase == READY and all(g.tables[-1][0]["healthy"] for g in gws)
    st = c.status()["gateway"]
    assert st["processes"] == 3 and st["serving"] == 3 and st["state"] == "serving"
    gws[1].dead = True                        # one gateway process dies: degraded, then replaced
    seen = []
    for _ in range(12):
        tick(c, clock, 1, dt=1.0)
        seen.append((c.phase, c.error))
    assert any(p == DEGRADED and "gateway 1" in e for p, e in seen), seen
    assert c.phase == READY and len([a for a in api.actors if isinstance(a, FakeGateway)]) == 4
    c.shutdown()
    assert all(g.phase == "stopped" for g in c.gws)


def test_one_gateway_process_does_not_ask_for_reuse_port():
    c, api, clock = make([spec("w0", port=9000)])
    tick(c, clock, 2)
    assert gateway(api).reuse_port is False


def test_not_ready_until_the_gateway_confirmed_the_healthy_table():
    c, api, clock = make([spec("w0", port=9000)])
    tick(c, clock, 3)
    api.hold_push = True
    workers(api)[0].state = "ready"
    tick(c, clock, 4)
    assert c.phase == STARTING                       # the gateway still routes by a table without w0
    for ref_holder in [c.gws[0].push_ref]:
        ref_holder.hold = False
    api.hold_push = False
    tick(c, clock, 1)
    assert c.phase == READY


def test_worker_that_fails_at_load_fails_the_deployment_with_its_reason():
    c, api, clock = make([spec("w0", port=9000), spec("w1", port=9001)])
    tick(c, clock, 2)
    w0 = workers(api)[0]
    w0.state, w0.reason = "failed", "failed to start: exited with status 1 while loading: out of memory"
    tick(c, clock, 2)
    assert c.phase == FAILED
    assert "worker w0: failed to start: exited with status 1 while loading: out of memory" in c.error


def test_unknown_node_fails_with_the_nodes_that_exist():
    c, api, clock = make([spec("w0", node="nowhere")])
    tick(c, clock, 2)
    assert c.phase == FAILED
    assert "node 'nowhere' is not in the Ray cluster" in c.error and "a (10.0.0.1)" in c.error
    assert "c (" not in c.error                             # dead nodes are not offered
    assert workers(api) == []


def test_lost_worker_actor_is_recreated_with_backoff_and_marked_resumed():
    c, api, clock = make([spec("w0", port=9000), spec("w1", port=9001)])
    tick(c, clock, 2)
    for w in workers(api):
        w.state = "ready"
    tick(c, clock, 2)
    assert c.phase == READY
    first = workers(api)[0]
    first.dead = True                                       # e.g. the actor process was kill -9'd
    tick(c, clock, 2)
    assert c.phase == DEGRADED and "w0" in c.error
    assert first in api.killed
    table = {r["name"]: r for r in gateway(api).tables[-1]}
    assert not table["w0"]["healthy"] and table["w1"]["healthy"]   # the gateway stops routing to it at once
    assert "backoff" in table["w0"]["detail"] and "worker actor died" in table["w0"]["detail"]
    tick(c, clock, 2)                                       # backoff 1 s: a new actor
    new = [w for w in workers(api) if w.name == "w0"][-1]
    assert new is not first and new.resumed is True
    new.state = "ready"
    tick(c, clock, 2)
    assert c.phase == READY
    st = {w["name"]: w for w in c.status()["workers"]}
    assert st["w0"]["restarts"] == 1 and st["w0"]["actor_restarts"] == 1


def test_the_early_llama_server_goes_to_the_first_actor_only():
    handover = {"state": "/run/w0.keeper.json", "owner": "/run/w0.owner.json"}
    c, api, clock = make([spec("w0", port=9000), spec("w1", port=9001)], early={"w0": handover})
    tick(c, clock)
    ws = {w.name: w for w in workers(api)}
    assert ws["w0"].adopt == handover and ws["w1"].adopt is None      # w1 had no early server
    ws["w0"].state = ws["w1"].state = "ready"
    tick(c, clock, 2)
    ws["w0"].dead = True                 # its keeper stops the adopted server with it: nothing left to adopt
    tick(c, clock, 6)
    new = [w for w in workers(api) if w.name == "w0"][-1]
    assert new is not ws["w0"] and new.adopt is None
    restarted, api2, clock2 = make([spec("w0", port=9000)], restarted=True, early={"w0": handover})
    tick(restarted, clock2)
    assert workers(api2)[0].adopt is None                 # a restarted controller: the first actor is long gone


def test_lost_worker_actors_give_up_after_the_bound():
    c, api, clock = make([spec("w0")], max_restarts=2)
    tick(c, clock, 2)
    workers(api)[0].state = "ready"
    tick(c, clock, 2)
    for _ in range(3):
        [w for w in workers(api) if not w.dead][-1].dead = True
        tick(c, clock, 12)
        ws = [w for w in workers(api) if not w.dead]
        for w in ws:
            w.state = "ready"
    st = c.status()["workers"][0]
    assert st["state"] == "failed" and "gave up after 3 lost worker actor(s)" in st["reason"]
    assert len(workers(api)) == 3


def test_actor_that_cannot_be_scheduled_fails_with_its_resources():
    c, api, clock = make([spec("w1", node="b")])
    api.hold_start = True
    tick(c, clock, 2)
    clock.t += 61
    c.update()
    assert c.phase == FAILED
    assert "not running on node b after 60s" in c.error and "'GPU': 1" in c.error


def test_gateway_that_cannot_listen_fails_the_deployment():
    c, api, clock = make([spec("w0")])
    api.gateway_fail = "OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8080): address in use"
    tick(c, clock, 2)
    assert c.phase == FAILED and "gateway cannot serve on 127.0.0.1:8080" in c.error and "address in use" in c.error


def test_a_raising_step_is_recorded_and_the_loop_goes_on():
    c, api, clock = make([spec("w0")])
    api.nodes_error = RuntimeError("GCS hiccup")
    tick(c, clock, 3)                                        # no exception escapes update()
    assert c.tick_errors >= 3 and "GCS hiccup" in c.status()["workers"][0]["last_error"]
    api.nodes_error = None
    tick(c, clock, 2)
    workers(api)[0].state = "ready"
    tick(c, clock, 2)
    assert c.phase == READY


def test_stale_status_is_not_routed():
    c, api, clock = make([spec("w0")])
    tick(c, clock, 2)
    workers(api)[0].state = "ready"
    tick(c, clock, 2)
    assert c.replica_table()[0]["healthy"]
    clock.t += 6                                             # no answer for longer than STALE_S
    assert not c.replica_table()[0]["healthy"]


def test_shutdown_stops_workers_and_gateway_and_kills_actors():
    c, api, clock = make([spec("w0", port=9000), spec("w1", port=9001)])
    tick(c, clock, 2)
    for w in workers(api):
        w.state = "ready"
    tick(c, clock, 2)
    workers(api)[1].dead = True                               # one actor already gone: shutdown goes on
    st = c.shutdown(timeout=5)
    assert c.phase == STOPPED and st["phase"] == STOPPED
    assert workers(api)[0].stopped and gateway(api).stopped
    assert all(a in api.killed for a in api.actors)
    assert c.update() == STOPPED                              # nothing restarts after shutdown


def test_status_shows_binding_devices_and_pending_workers():
    s = LaunchSpec(name="w0", argv=("numactl", "--cpunodebind=1", "--membind=1", "--", "llama-server", "-t", "8"),
                   env={"CUDA_VISIBLE_DEVICES": "2,3"}, port=9000)
    c, api, clock = make([s])
    st = c.status()["workers"][0]
    assert st["state"] == "pending" and st["pid"] is None
    assert st["binding"] == "numactl --cpunodebind=1 --membind=1, -t 8"
    assert st["devices"] == "cuda:2,3"


def test_resolve_node_rules():
    assert resolve_node("hostb", NODES, "id-a").node_id == "id-b"          # short hostname
    assert resolve_node("local", NODES, "id-a").node_id == "id-a"          # 'local' = the up node
    with pytest.raises(NodeMissing, match="is not in the Ray cluster"):
        resolve_node("c", NODES, "id-a")                                    # dead


def test_a_restarted_controller_restarts_workers_instead_of_failing():
    c, api, clock = make([spec("w0")], restarted=True)
    tick(c, clock, 2)
    first = workers(api)[0]
    assert first.resumed is True                             # waits for the old port, restarts on failure
    first.dead = True                                        # e.g. the old llama-server still held the port
    tick(c, clock, 2)
    assert c.phase == STARTING and c.slots[0].phase == "backoff"
    tick(c, clock, 4)
    [w for w in workers(api) if not w.dead][-1].state = "ready"
    tick(c, clock, 3)
    assert c.phase == READY and c.status()["restarted"] is True


def test_status_carries_the_plan():
    c, api, clock = make([spec("w0"), spec("w1", port=9001)])
    assert c.status()["plan"] == {"workers": 2}


def test_the_replica_table_gives_each_planned_workers_slots_to_the_gateway():
    from dataclasses import replace
    from orchestrator.launch.settings import WorkerSettings
    planned = replace(spec("w0", port=9000), settings=WorkerSettings(parallel=3))
    c, api, clock = make([planned, spec("w1", port=9001)])
    tick(c, clock)
    slots = {r["name"]: r["slots"] for r in c.replica_table()}
    assert slots == {"w0": 3, "w1": None}        # a hand-written argv says nothing: the gateway assumes its default


def test_the_gateway_is_started_with_the_topologys_cors_policy():
    specs = [spec("w0", port=9000)]
    c, api, clock = make(specs)
    c.dep = c.dep.copy(gateway_cors="https://app.example.com")
    tick(c, clock, 3)
    assert gateway(api).cors_origins == "https://app.example.com"
