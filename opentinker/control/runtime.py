"""Start the components of a job and wire them over the bus: on Ray (one actor, hence one
process, per component) or in this process (``backend = "local"``: the same classes, the same
sockets, for tests and debugging).

Ray starts, places and supervises the actors and hands out endpoint addresses; it is never
the data plane. The driver makes one Ray call per training step or evaluation, whatever the
number of episodes; every actor counts the Ray calls it serves (:meth:`Job.ray_calls`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from opentinker.bus.auth import (
    Credentials,
    run_curve,
    run_secret,
    set_run_curve,
)
from opentinker.bus.common import CurveKeys
from opentinker.config import JobConfig
from opentinker.control.component import Component, ComponentDied, describe, node
from opentinker.control.placement import (
    dealer,
    init_ray,
    place,
    placed_on_resources,
    scheduler_devices,
    scheduler_name,
    scheduler_resources,
)
from opentinker.engine.request_checks import DEFAULT_MAX_NEW_TOKENS
from protocols.messages import AdamParams

if TYPE_CHECKING:
    from opentinker.control.attach import Attachment

log = logging.getLogger(__name__)


def _learner_kwargs(cfg: JobConfig, scheduler_ep: str, policy: str, run_dir: str,
                    scheduler_auth: tuple[str, str] | None = None) -> dict[str, Any]:
    tc = cfg.train_for(policy)
    record = str(Path(run_dir) / "trajectories" / f"{policy}.jsonl") if run_dir and tc.record_trajectories else ""
    return {
        "state_path": str(Path(run_dir) / "learners" / f"{policy}.live.json") if run_dir else "",
        "policy": policy,
        "scheduler_endpoint": scheduler_ep,
        "advantage": tc.advantage,
        "advantage_config": tc.advantage_config(),
        "loss": tc.loss,
        # The trainer scores replies at the temperature they were sampled at (DESIGN §6).
        "loss_config": {**tc.loss_config(),
                        **({"temperature": cfg.sampling.temperature} if cfg.sampling.temperature != 1.0 else {})},
        "adam": msgspec.to_builtins(AdamParams(lr=tc.lr, weight_decay=tc.weight_decay, grad_clip=tc.grad_clip)),
        "lr_decay_steps": cfg.train.steps if tc.lr_schedule == "linear" else 0,
        "game": cfg.game,
        "move_values_against": dict(tc.move_values_against),
        "record_path": record,
        "epochs": tc.epochs,
        "minibatches": tc.minibatches,
        "seed": cfg.seed,
        "frozen": next(p.frozen for p in cfg.policies if p.name == policy),
        "scheduler_auth": scheduler_auth,
    }


class Job:
    """A running job: the components and a handle on the coordinator.

    Args:
        cfg: the job.
        model_path: the resolved base model.
        run_dir: the run's folder; learners record trajectories under it (``""``: nowhere).
        scheduler_only: start only the scheduler (offline jobs talk to it directly at
            :attr:`scheduler_endpoint`, presenting :attr:`scheduler_credentials`).

    With ``cfg.runtime.scheduler`` set, no scheduler is started: the job is opened on that
    shared scheduler (:func:`opentinker.control.attach.attach`), every component presents the
    job's credentials to it, and :meth:`shutdown` closes the job there (its adapters are freed).
    """

    def __init__(self, cfg: JobConfig, model_path: str, run_dir: str = "", scheduler_only: bool = False) -> None:
        if not scheduler_only:
            from opentinker.training.learner import check_job

            check_job(cfg)  # a bad algorithm name fails here, not inside an actor
        self.cfg = cfg
        self.model_path = model_path
        self.run_dir = str(run_dir)
        self.scheduler_only = scheduler_only
        self.scheduler_endpoint = ""
        """The (first) scheduler's bus endpoint."""
        self.devices = scheduler_devices(cfg)[:1 if scheduler_only else None]
        """Each of the job's schedulers' device (``runtime.devices``); one on a shared scheduler,
        and for ``scheduler_only`` (evaluation, play, offline jobs talk to one scheduler)."""
        self.placement = place(cfg) if len(self.devices) > 1 else {p.name: 0 for p in cfg.policies}
        """Policy -> the index of the scheduler that holds it."""
        self.scheduler_endpoints: list[str] = []
        """Every scheduler's endpoint, in the order of :attr:`devices`."""
        self.scheduler_credentials: Credentials | None = None
        """What this job's components present to the scheduler (None: the run's own secret)."""
        self.attachment: Attachment | None = None
        self.backend = cfg.runtime.backend
        self._handles: dict[str, Any] = {}
        self._where: dict[str, dict[str, Any]] = {}
        """Component name -> its pid and node (Ray), to name one that dies."""
        self._kwargs: dict[str, tuple[str, dict[str, Any]]] = {}
        """Components that can be restarted (env runners, learners) -> (kind, constructor arguments)."""
        self.restarts = 0
        """Components restarted so far (:meth:`supervised`)."""
        self.said: Callable[[str], None] = log.warning
        """Where a restart is told (:func:`opentinker.run.run_job` prints it)."""
        self._curve: tuple[str, str, str] | None = None
        """The run's CURVE pair and where servers bind (``""``: each node's address; 127.0.0.1 on
        this machine's own Ray), handed to every component; None: PLAIN with the run's secret."""
        if cfg.runtime.curve or cfg.runtime.address:
            keys = CurveKeys.generate()
            self._curve = (keys.public.decode(), keys.secret.decode(), "" if cfg.runtime.address else "127.0.0.1")
        self._driver_curve = run_curve()
        """This process's CURVE setting before the job, restored by :meth:`shutdown`."""
        threads = cfg.model.threads or os.cpu_count() or 1
        m = cfg.model
        # The scheduler reads and writes adapters only inside the run's folder (none without one)
        # and only reads the policies' warm-start adapters.
        sched_kwargs = {"model_path": model_path, "device": m.device, "threads": threads, "engine": m.engine,
                        "adapter_roots": [self.run_dir] if self.run_dir else [],
                        "read_roots": [p.init for p in cfg.policies if p.init],  # warm starts: read only
                        "max_new_tokens": max(DEFAULT_MAX_NEW_TOKENS, cfg.sampling.max_tokens),
                        "engine_options": {"kv_budget_bytes": m.kv_budget_mb << 20, "block_size": m.kv_block_size,
                                           "train_memory_bytes": m.train_memory_mb << 20,
                                           "max_batch_tokens": m.max_batch_tokens, "dtype": m.dtype,
                                           "cuda_graphs": m.cuda_graphs}}
        if cfg.runtime.scheduler:
            from opentinker.control.attach import attach

            self.attachment = attach(cfg.runtime.scheduler, cfg.name, model_path, sched_kwargs["adapter_roots"],
                                     sched_kwargs["read_roots"], cfg.runtime.priority, cfg.runtime.startup_timeout_s)
            self.scheduler_endpoint = self.attachment.endpoint
            self.scheduler_endpoints = [self.scheduler_endpoint]
            self.scheduler_credentials = self.attachment.credentials
        try:
            if self.backend == "ray":
                init_ray(cfg.runtime.address)
            if self._curve is not None:  # the driver's own clients (and a local job's components)
                set_run_curve(self._curve[:2], host=self._curve[2] or node()[0])
            if self.backend == "ray":
                self._start_ray(sched_kwargs)
            else:
                self._start_local(sched_kwargs)
        except BaseException:
            if self.attachment is not None:
                self.attachment.close()
            self._restore_curve()
            raise

    def _restore_curve(self) -> None:
        if self._curve is not None:
            prev = self._driver_curve
            set_run_curve(prev[:2] if prev else None, prev[2] if prev else "127.0.0.1")

    @property
    def routes(self) -> dict[str, str]:
        """Policy -> its scheduler's endpoint."""
        return {p: self.scheduler_endpoints[i] for p, i in self.placement.items()}

    def _scheduler_kwargs(self, sched_kwargs: dict[str, Any], i: int) -> dict[str, Any]:
        """Scheduler ``i``'s arguments: the job's, on its device."""
        return {**sched_kwargs, "device": self.devices[i]}

    def _coordinator_kwargs(self) -> dict[str, Any]:
        return {"cfg": msgspec.to_builtins(self.cfg), "model_path": self.model_path,
                "scheduler_endpoint": self.scheduler_endpoint, "runner_endpoints": [], "learner_endpoints": {},
                "scheduler_auth": self._auth, "routes": self.routes,
                "transcripts_path": str(Path(self.run_dir) / "transcripts.txt") if self.run_dir else ""}

    @property
    def _auth(self) -> tuple[str, str] | None:
        return self.scheduler_credentials.pair() if self.scheduler_credentials is not None else None

    # --------------------------------------------------------------------------- local

    def _start_local(self, sched_kwargs: dict[str, Any]) -> None:
        cfg = self.cfg
        if self.attachment is None:
            for i in range(len(self.devices)):  # (scheduler_only: the devices were cut to one)
                sched = self._add(scheduler_name(i), Component("scheduler", self._scheduler_kwargs(sched_kwargs, i)))
                self.scheduler_endpoints.append(sched.start())
            self.scheduler_endpoint = self.scheduler_endpoints[0]
        if self.scheduler_only:
            return
        runners = []
        for i in range(cfg.runtime.env_runners):
            r = self._add(f"env_runner{i}", Component("env_runner", self._runner_kwargs(i)))
            runners.append(r.start())
        learners = {}
        for p in cfg.policies:
            ln = self._add(f"learner_{p.name}", Component("learner", _learner_kwargs(
                cfg, self.routes[p.name], p.name, self.run_dir, self._auth)))
            learners[p.name] = tuple(ln.start())
        coord = self._add("coordinator", Component("coordinator", {
            **self._coordinator_kwargs(), "runner_endpoints": runners, "learner_endpoints": learners}))
        coord.start()

    def _add(self, name: str, handle: Any) -> Any:
        self._handles[name] = handle
        return handle

    def _runner_kwargs(self, i: int) -> dict[str, Any]:
        """An env runner's arguments: it may play the registered games and the job's own, sends
        each policy's requests to that policy's scheduler, and waits for one as long as the job
        waits for any request (``runtime.timeout_s``)."""
        from opentinker.rollout.env_runner import runner_share

        return {"name": f"runner{i}", "scheduler_endpoint": self.scheduler_endpoint, "model_path": self.model_path,
                "games": (self.cfg.game,), "max_episodes": runner_share(self.cfg.runtime.env_runners),
                "scheduler_auth": self._auth, "routes": self.routes, "sample_timeout_s": self.cfg.runtime.timeout_s}

    # --------------------------------------------------------------------------- ray

    def _start_ray(self, sched_kwargs: dict[str, Any]) -> None:
        import ray

        cfg = self.cfg
        actor_cls = ray.remote(num_cpus=0)(Component)
        secret = run_secret().decode()  # every actor's sockets present and accept the driver's
        timeout = cfg.runtime.startup_timeout_s
        # On a cluster, env runners and learners (CPU work) are dealt to the nodes in turn.
        dealt = dealer(actor_cls)
        self._secret = secret
        self._placed = {**{f"env_runner{i}": i for i in range(cfg.runtime.env_runners)},
                        **{f"learner_{p.name}": cfg.runtime.env_runners + j for j, p in enumerate(cfg.policies)}}
        """The turn of each env runner and learner in the deal, for a restart too."""
        self._dealt = dealt

        def start_all(named: dict[str, Any]) -> dict[str, Any]:
            refs = {name: h.start.remote() for name, h in named.items()}
            _ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
            if pending:
                names = [n for n, r in refs.items() if r in pending]
                raise TimeoutError(f"actors still starting after {timeout:.0f} s: {names}")
            return {name: ray.get(ref) for name, ref in refs.items()}

        if self.attachment is None:  # one per device, each on a node with what it asks for (a GPU, ...)
            scheds = {}
            for i, device in enumerate(self.devices):
                sched_cls = placed_on_resources(actor_cls, scheduler_resources(cfg, device), ray.nodes())
                scheds[scheduler_name(i)] = self._add(scheduler_name(i), sched_cls.remote(
                    "scheduler", self._scheduler_kwargs(sched_kwargs, i), secret, self._curve))
            eps = start_all(scheds)
            self.scheduler_endpoints = [eps[scheduler_name(i)] for i in range(len(self.devices))]
            self.scheduler_endpoint = self.scheduler_endpoints[0]
        if self.scheduler_only:
            return
        group = {}
        for i in range(cfg.runtime.env_runners):
            name = f"env_runner{i}"
            spec = self._kwargs[name] = ("env_runner", self._runner_kwargs(i))  # for restart
            group[name] = self._add(name, dealt(self._placed[name]).remote(*spec, secret, self._curve))
        for p in cfg.policies:
            name = f"learner_{p.name}"
            spec = self._kwargs[name] = ("learner", _learner_kwargs(cfg, self.routes[p.name], p.name, self.run_dir,
                                                                    self._auth))
            group[name] = self._add(name, dealt(self._placed[name]).remote(*spec, secret, self._curve))
        eps = start_all(group)
        runners = [eps[f"env_runner{i}"] for i in range(cfg.runtime.env_runners)]
        learners = {p.name: tuple(eps[f"learner_{p.name}"]) for p in cfg.policies}
        coord = self._add("coordinator", actor_cls.remote("coordinator", {
            **self._coordinator_kwargs(), "runner_endpoints": runners, "learner_endpoints": learners}, secret,
            self._curve))
        start_all({"coordinator": coord})
        # Where each one runs, to name a component that dies (ComponentDied).
        self._where = {name: ray.get(h.info.remote()) for name, h in self._handles.items()}

    # --------------------------------------------------------------------------- calls

    def coordinator(self, method: str, *args: Any) -> Any:
        """Call a coordinator method (one Ray call on the Ray backend)."""
        return self.call("coordinator", method, *args)

    def call(self, component: str, method: str, *args: Any) -> Any:
        """Call a method of a component (``coordinator``, ``learner_<policy>``, ...): one Ray
        call on the Ray backend, for control (small arguments), never for data."""
        h = self._handles[component]
        if self.backend != "ray":
            return h.call(method, *args)
        import ray

        try:
            return ray.get(h.call.remote(method, *args), timeout=self.cfg.runtime.timeout_s * 4)
        except ray.exceptions.GetTimeoutError:
            raise  # a call still running (the component is busy, not dead): asking it would time out too
        except Exception as e:  # a component that died: say which, not a bus endpoint
            dead = self.dead()
            if dead:
                raise ComponentDied(dead, ", ".join(describe(n, self._where.get(n)) for n in dead), e) from e
            raise

    def supervised(self, method: str, *args: Any) -> Any:
        """A coordinator call that survives dead env runners and learners: when one died
        (:class:`ComponentDied` naming env runners or learners), each is started again in a
        new process, the coordinator reconnects to it, and the call is made again, up to
        ``runtime.max_restarts`` restarts over the job. A training step played again sends its
        trajectories again: learners keep one copy of each, so every episode is trained on
        once; a restarted learner takes over its predecessor's state as the step began
        (:mod:`opentinker.training.learner`). Anything else that died (the scheduler, the
        coordinator), or a learner that cannot take over (the step had already updated its
        adapter), is raised as the :class:`ComponentDied` it is."""
        while True:
            try:
                return self.coordinator(method, *args)
            except ComponentDied as e:
                if any(n not in self._kwargs for n in e.names) or self.restarts + len(e.names) > self.cfg.runtime.max_restarts:
                    raise
                for name in e.names:
                    try:
                        endpoint = self.restart(name)
                    except Exception as err:  # a learner that cannot take over (its own error says why)
                        log.warning("%s could not be started again in its step: %s", name, err)
                        raise e from err
                    if name.startswith("env_runner"):
                        self.coordinator("replace_runner", int(name.removeprefix("env_runner")), endpoint)
                    else:
                        self.coordinator("replace_learner", name.removeprefix("learner_"), list(endpoint))
                    self.restarts += 1
                    what = f"step {args[0]}" if method == "train_step" and args else method
                    self.said(f"{e} during {what}: started again as {describe(name, self._where.get(name))} and "
                              f"{what} made again (restart {self.restarts} of at most {self.cfg.runtime.max_restarts})")

    def restart(self, name: str) -> Any:
        """Start component ``name`` again in a new Ray actor (the old one killed, if it is not
        gone already; a learner takes over its predecessor's state); returns what its
        ``start`` returns (its endpoint; a learner's request and trajectory endpoints)."""
        import ray

        kind, kwargs = self._kwargs[name]
        if kind == "learner":
            kwargs = {**kwargs, "restore": True}
        old = self._handles[name]
        try:
            ray.kill(old)
        except Exception as e:  # noqa: BLE001  (already dead)
            log.debug("kill %s: %s", name, e)
        self._await_gone(name, old)
        h = self._handles[name] = self._dealt(self._placed[name]).remote(kind, kwargs, self._secret, self._curve)
        endpoint = ray.get(h.start.remote(), timeout=self.cfg.runtime.startup_timeout_s)
        self._where[name] = ray.get(h.info.remote())
        return endpoint

    def _await_gone(self, name: str, handle: Any, timeout: float = 60.0) -> None:
        """Wait until the actor ``handle`` is gone (its calls fail as a dead actor's): one that
        hung rather than died must not act after its successor has started (a learner's
        ``OptimStep`` or state file). ``TimeoutError`` naming ``name`` after ``timeout``."""
        import ray

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ray.get(handle.info.remote(), timeout=1.0)
            except ray.exceptions.RayActorError:
                return
            except ray.exceptions.GetTimeoutError:
                pass  # not answering yet, not known dead either
            time.sleep(0.1)
        raise TimeoutError(f"{describe(name, self._where.get(name))} was killed but has not gone after {timeout:.0f} s")

    def dead(self, timeout: float = 10.0) -> list[str]:
        """Names of the Ray actors that no longer answer (their process died)."""
        import ray

        refs = {name: h.info.remote() for name, h in self._handles.items()}
        out = []
        for name, ref in refs.items():
            try:
                ray.get(ref, timeout=timeout)
            except Exception:  # noqa: BLE001  (ActorDiedError, a timeout: it is gone either way)
                out.append(name)
        return out

    def learner_states(self) -> dict[str, dict[str, Any]]:
        """Policy -> its learner's :meth:`~opentinker.training.learner.Learner.state_dict`."""
        return {p.name: self.call(f"learner_{p.name}", "state_dict") for p in self.cfg.policies}

    def load_learner_states(self, states: dict[str, dict[str, Any]]) -> None:
        """Restore learner states (e.g. read back from ``learner_state.json`` files)."""
        for name, state in states.items():
            self.call(f"learner_{name}", "load_state_dict", state)

    def info(self) -> dict[str, dict[str, Any]]:
        """Per component: Ray calls served, process id, bus counters."""
        if self.backend == "ray":
            import ray

            return {n: ray.get(h.info.remote()) for n, h in self._handles.items()}
        return {n: h.info() for n, h in self._handles.items()}

    def ray_calls(self) -> int:
        return sum(i["calls"] for i in self.info().values())

    def shutdown(self) -> None:
        for name in reversed(list(self._handles)):
            h = self._handles[name]
            try:
                if self.backend == "ray":
                    import ray

                    ray.get(h.stop.remote(), timeout=30)
                    ray.kill(h)
                else:
                    h.stop()
            except Exception as e:  # shut down the rest regardless
                if "ActorDied" in type(e).__name__:  # already gone: said once, by ComponentDied
                    log.info("shutdown of %s: already stopped", name)
                else:
                    log.warning("shutdown of %s failed", name, exc_info=True)
        self._handles.clear()
        if self.attachment is not None:
            self.attachment.close()
        self._restore_curve()

