"""Run by ``test_cluster_curve`` in a process of its own: a simulated Ray cluster of two nodes on
this machine (``ray.cluster_utils.Cluster``, every node on 127.0.0.1, the second with a custom
resource ``accelerator`` the job's scheduler asks for), a job joined to it with
``runtime.address`` (so its bus is CURVE, servers bound to their node's address), run
undisturbed for 3 steps; the same job with its learner killed (SIGKILL) just before step 3,
which it survives by starting the learner again (on a live node) in its step; and with its
scheduler killed there, which it survives by resuming from its checkpoint of step 2. Prints one JSON object:
each run's accounting (metrics rows, trajectories per step), where its components ran, and
what the disturbed run said.

Usage: ``python tests/cluster_job.py OUT_DIR`` (with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in
the environment, so Ray resolves 127.0.0.1 to itself rather than to a guessed interface)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import msgspec
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))

from test_reliability import _accounting, _cfg, killed_during

from opentinker.config import JobConfig
from opentinker.run import run_job

NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}


def accounting(run: Path, cfg: JobConfig, info: dict) -> dict:
    """What a run did (:func:`test_reliability._accounting`) and where each component ran, with
    which bus."""
    rows, steps = _accounting(run, cfg)
    return {"rows": rows, "components": {name: {"node_id": i["node_id"], "bus": i["bus"]} for name, i in info.items()},
            "steps": {step: dict(zip(("trajectories", "unique", "episodes_as_configured", "n_datums"), s, strict=True))
                      for step, s in steps.items()}}


def main(out: Path) -> None:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    cluster.add_node(**NODE, resources={"accelerator": 1})  # where the scheduler goes, by its resources
    cluster.wait_for_nodes()
    try:
        def cfg(steps: int) -> JobConfig:
            return msgspec.convert({**msgspec.to_builtins(_cfg(out, steps)), "runtime": {
                "backend": "ray", "address": cluster.address, "env_runners": 2, "timeout_s": 120,
                "scheduler_resources": {"accelerator": 1}}}, JobConfig)

        runs, said, killed = {"whole": run_job(cfg(3), run_dir=out / "whole")}, {}, {}
        for name, component in (("restarted", "learner_main"), ("resumed", "scheduler")):
            text = io.StringIO()
            with killed_during(3, component) as pids:
                runs[name] = run_job(cfg(3), Console(file=text, width=400), run_dir=out / name)
            said[name], killed[name] = text.getvalue(), pids
        print(json.dumps({
            **{name: {**accounting(r.run_dir, cfg(3), r.info), "final_eval": {
                k: v for k, v in r.last_eval.items() if k.endswith(("/success", "/hands", "/invalid_rate"))}}
               for name, r in runs.items()},
            "killed": killed, "said": said, "nodes": len([n for n in ray.nodes() if n["Alive"]]),
            "accelerator_node": next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "accelerator" in n["Resources"]),
        }))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
