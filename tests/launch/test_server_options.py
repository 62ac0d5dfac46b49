"""The table of llama-server's options (orchestrator/backend/server_options.py) is the one declaration: every option
that renders a settings field reads back to the same settings, every field that reaches llama-server's argv has an
option, the flags a topology owns and the features --help shows are the table's."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest

from orchestrator.backend.info import FORMER_FEATURES, BackendInfo, Flavor, parse_help
from orchestrator.backend.server_options import (
    ALL_LAYERS, BY_FEATURE, IK_MARKERS, OFFLOAD_NEVER, OPTIONS, OWNED_FLAGS, PLACEMENT, RENDERS, Choice, Int,
    LoadMode, Numbers, OffloadBatch, OnOff, Overrides, Switch, Value, field_flags, long_flag,
)
from orchestrator.launch.llama_args import parse_server_args, server_args, server_env
from orchestrator.launch.settings import FORMER_FIELDS, WorkerSettings

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "backend"
# WorkerSettings fields that never become a llama-server flag: the GPUs it sees (CUDA_VISIBLE_DEVICES), the NUMA
# binding (numactl) and balancing (a wrapper), and the user's own flags
NOT_FLAGS = {"gpus", "numa", "disable_numa_balancing", "extra_args"}
EVERY_FEATURE = frozenset(BY_FEATURE)
MAINLINE = BackendInfo(server="llama-server", flavor=Flavor.MAINLINE, features=EVERY_FEATURE - IK_MARKERS)
IK = BackendInfo(server="llama-server", flavor=Flavor.IK, features=EVERY_FEATURE)


def _samples(field: str, value: Value, default) -> list:
    """Values of a field other than its default, one per way the option writes them."""
    if isinstance(value, LoadMode):
        return ["pinned", "mlock"]
    if isinstance(value, OffloadBatch):
        return [64, OFFLOAD_NEVER]
    if isinstance(value, Choice):
        return [c for c in value.choices if c != default]
    if isinstance(value, (Switch, OnOff)):
        return [v for v in (True, False) if v != default and (v or not isinstance(value, Switch))]
    if isinstance(value, Numbers):
        return [(3.0, 1.0), (0.5, 0.25)]
    if isinstance(value, Overrides):
        return [((r"blk\.0\.ffn_up_exps", "CPU"), (r"blk\.1\.", "CUDA0"))]
    if field == "n_gpu_layers":
        return [0, 12, ALL_LAYERS]
    if isinstance(value, Int):
        return [7]
    return ["q8_0"]


def _cases():
    defaults = {f.name: f.default for f in fields(WorkerSettings) if f.name in RENDERS}
    for name, o in RENDERS.items():
        for v in _samples(name, o.value, defaults[name]):
            for backend in (MAINLINE, IK) if o.on_ik else (MAINLINE,):
                yield pytest.param(name, v, backend, id=f"{name}={v}-{backend.flavor}")
    # mainline without --load-mode: --no-mmap, then --mlock
    for v in ("pinned", "mlock"):
        yield pytest.param("load_mode", v, replace(MAINLINE, features=MAINLINE.features - {"load_mode"}),
                           id=f"load_mode={v}-no-mmap")


@pytest.mark.parametrize("name, value, backend", list(_cases()))
def test_every_option_renders_and_reads_back_to_the_same_settings(name, value, backend):
    s = WorkerSettings(**{name: value})
    o = RENDERS[name]
    while o.within is not None:                           # the expert cache's options go with a cache
        s = replace(s, **{o.within: 7})
        o = RENDERS[o.within]
    argv, env = server_args(s, backend), server_env(s, backend)
    assert parse_server_args(argv, env) == s, argv
    assert set(argv) & set(field_flags(name)) or env, f"{name}={value!r} left no trace: {argv}"


def test_every_settings_field_that_reaches_the_argv_has_an_option():
    """A new WorkerSettings field is either declared in the table (then rendered, read back, owned and detected by
    what the table says) or named here as something that is not a llama-server flag."""
    assert {f.name for f in fields(WorkerSettings)} - set(RENDERS) == NOT_FLAGS
    assert set(RENDERS) <= {f.name for f in fields(WorkerSettings)}


def test_every_spelling_belongs_to_one_option_and_one_long_name():
    spellings = [f for o in OPTIONS for f in o.flags]
    assert len(spellings) == len(set(spellings))
    assert all(f.startswith("-") for f in spellings)
    for o in OPTIONS:
        assert {long_flag(f) for f in o.flags} == {o.long} and o.long.startswith("--")


def test_owned_flags_are_the_table_s_and_name_real_topology_keys():
    from orchestrator.config import schema
    from orchestrator.config.reference import keys

    assert schema.OWNED_FLAGS is OWNED_FLAGS
    real = {k.key for k in keys()}
    owners = {o.owner for o in OPTIONS if o.owner}
    assert owners - {PLACEMENT} <= real
    assert set(PLACEMENT.split(" / ")) <= real
    # the plan decides placement; every flag that places weights is owned
    assert {"-ngl", "-ot", "--cpu-moe", "--n-cpu-moe", "-ts", "-mg", "--fit", "-dev", "--fit-target"} <= {
        f for f, k in OWNED_FLAGS.items() if k == PLACEMENT}


def test_a_topology_may_not_give_an_owned_flag_in_extra_args():
    from orchestrator.config import Topology
    from orchestrator.errors import ConfigError

    for flag in ("--moe-cache-slots", "-tb", "--no-mmap"):
        with pytest.raises((ConfigError, ValueError), match=OWNED_FLAGS[flag].split(".")[-1]):
            Topology.model_validate({"model": "m.gguf", "workers": {"extra_args": [flag, "1"]}})


@pytest.mark.parametrize("o", [o for o in OPTIONS if o.feature], ids=lambda o: o.feature)
def test_each_feature_is_detected_from_its_own_help_line_only(o):
    """A --help that lists only this option shows only its feature (and a longer flag that starts with its
    spelling does not show it: --moe-cache-prefill-ahead is not --moe-cache-prefill)."""
    flavor, feats, _modes, _gpu = parse_help(f"{', '.join(o.flags)} N        what it does\n")
    assert feats - {"override_tensor"} == {o.feature} - {"override_tensor"}
    assert (flavor is Flavor.IK) == o.ik_only
    longer = parse_help(f"{o.help_text}-more N        another option\n")[1]
    assert o.feature not in longer


@pytest.mark.parametrize("help_file", sorted(FIX.glob("*help*.txt")), ids=lambda p: p.name)
def test_every_feature_detected_in_a_real_help_maps_to_an_option(help_file):
    text = help_file.read_text()
    _flavor, feats, modes, _gpu = parse_help(text)
    assert {f for f in feats if not f.startswith("sm_")} <= set(BY_FEATURE)
    assert {f for f in feats if f.startswith("sm_")} == {f"sm_{m}" for m in modes}
    for f in feats - {"override_tensor"} - {f"sm_{m}" for m in modes}:
        assert BY_FEATURE[f].help_text in text


def test_slot_assignment_is_one_value_written_as_the_flag_takes_it():
    for where in ("device", "host"):
        s = WorkerSettings(expert_cache_mib=512, expert_cache_slots=where)
        argv = server_args(s, MAINLINE)
        assert argv[argv.index("--moe-cache-slots") + 1] == where
        assert parse_server_args(argv).expert_cache_slots == where
    assert "--moe-cache-slots" not in server_args(WorkerSettings(expert_cache_mib=512), MAINLINE)   # the server's own
    assert "--moe-cache-slots" not in server_args(WorkerSettings(expert_cache_slots="device"), MAINLINE)  # no cache
    with pytest.raises(ValueError, match="expert_cache_slots"):
        WorkerSettings(expert_cache_slots="gpu")
    assert parse_server_args(["--moe-cache-slots", "gpu"]).extra_args == ("--moe-cache-slots", "gpu")
    # a plan document that carried the assignment as a boolean reads as the value
    assert WorkerSettings.from_dict({"moe_cache_device_slots": True}).expert_cache_slots == "device"
    assert WorkerSettings.from_dict({"moe_cache_device_slots": False}).expert_cache_slots is None


def test_plan_documents_with_the_former_field_names_read_the_same():
    """Settings written under the flags' spelling (``moe_cache_*``) read as the fields of the project's name; a
    document carrying both keeps the newer one."""
    new = WorkerSettings(expert_cache_mib=3072, expert_cache_max_batch=16, expert_cache_cpu_misses=True,
                         expert_cache_prefetch=True, expert_cache_slots="device", expert_cache_stage_buffers=2,
                         expert_cache_stage_min_batch=401)
    old = {former: getattr(new, now) for former, now in FORMER_FIELDS.items()}
    assert set(old) == {f"moe_cache_{n}" for n in ("mib", "max_batch", "cpu_misses", "prefetch", "slots",
                                                     "prefill_ahead", "prefill_ahead_min_batch")}
    assert WorkerSettings.from_dict(old) == new == WorkerSettings.from_dict(new.to_dict())
    assert not set(FORMER_FIELDS) & set(new.to_dict())           # written only under the new names
    assert WorkerSettings.from_dict({"moe_cache_mib": 1, "expert_cache_mib": 2}).expert_cache_mib == 2
    assert server_args(WorkerSettings.from_dict(old), MAINLINE) == server_args(new, MAINLINE)


def test_backends_recorded_with_the_former_feature_names_read_the_same():
    """A plan document's backend written when the expert cache's features said ``moe_cache`` offers the same
    options now: the argv rendered from it is the same."""
    now = replace(MAINLINE, features=MAINLINE.features | set(FORMER_FEATURES.values()))
    recorded = {**now.to_dict(), "features": sorted((now.features - set(FORMER_FEATURES.values()))
                                                    | set(FORMER_FEATURES))}
    assert BackendInfo.from_dict(recorded) == now
    s = WorkerSettings(expert_cache_mib=512, expert_cache_slots="device", expert_cache_stage_buffers=2,
                       expert_cache_prefetch=True)
    assert server_args(s, BackendInfo.from_dict(recorded)) == server_args(s, now)
    assert {"--moe-cache-slots", "--moe-cache-prefill-ahead", "--moe-cache-prefetch"} <= set(server_args(s, now))
