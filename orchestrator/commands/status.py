"""orchestrator status: what the running deployment is doing, per worker."""

from __future__ import annotations

import argparse

HELP = ("Show the running workers: state, pid, node, binding, devices, memory, tok/s, time to first token, "
        "restarts, last error, the expert cache's live hit rate beside the predicted one")
DESCRIPTION = (HELP + ". Exit status: 0 when every worker is ready, 1 while starting or degraded, "
               "2 when no deployment is running or Ray cannot be reached.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", "-n", default=None,
                   help="the deployment's Ray namespace (default: the only one recorded, else 'orchestrator')")
    p.add_argument("--json", action="store_true", help="print the full status as JSON")


def pick_namespace(given: str | None) -> str:
    """The namespace a command acts on: the given one, else the only deployment recorded, else the default."""
    from orchestrator.cluster import state

    if given:
        return state.check_namespace(given)

    rec = state.recorded()
    return rec[0] if len(rec) == 1 else "orchestrator"


def run(args: argparse.Namespace) -> int:
    import json

    from orchestrator.cluster import status
    from orchestrator.cluster.live_routing import compare_hit_rates, format_hit_rates
    from orchestrator.cluster.view import format_status

    st = status(pick_namespace(args.namespace))
    add_recent_latency(st)
    st["expert_cache_hit_rates"] = compare_hit_rates(st)
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True, default=str))
    else:
        print(format_status(st))
        for line in format_hit_rates(st["expert_cache_hit_rates"], st.get("live_routing")):
            print(line)
    return 0 if st.get("phase") == "ready" else 1


def add_recent_latency(st: dict, timeout: float = 3.0) -> None:
    """Puts each worker's recent latency, as the gateway exported it to Ray's metrics endpoint, under its
    ``latency`` key, and its tokens/s as exported there (the gauges Prometheus and Grafana read) over the ones its
    actor sampled last, so ``status`` and the dashboards agree; or says in ``latency_error`` why it cannot (the
    rest of the status stands either way, with the actor's own tokens/s)."""
    import urllib.error
    import urllib.request

    from orchestrator.cluster.latency import recent_from_page, worker_rates_from_page

    url = st.get("metrics_url")
    if not url:
        st["latency_error"] = "no metrics endpoint recorded (a deployment on a Ray cluster it joined)"
        return
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            page = r.read(64 << 20).decode("utf-8", "replace")
    except (OSError, urllib.error.URLError, ValueError) as e:
        st["latency_error"] = f"Ray's metrics endpoint {url} did not answer ({getattr(e, 'reason', None) or e})"
        return
    recent = recent_from_page(page)
    rates = worker_rates_from_page(page)
    for w in st.get("workers") or []:
        w["latency"] = recent.get(w.get("name"), {})
        exported = rates.get(w.get("name"))
        if exported:
            w["metrics"] = {**(w.get("metrics") or {}), **exported}
