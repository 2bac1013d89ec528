"""Render the README's result tables from the JSON under ``benchmarks/results/``.

A block in README.md is a pair of marker lines with the rendered markdown between them::

    <!-- results: NAME -->
    | ... |
    <!-- /results -->

``NAME`` is a key of ``RENDERERS``; its function reads the results folder and returns the
text between the markers. ``python benchmarks/readme.py`` rewrites every block in place;
``--check`` prints a unified diff and exits 1 when README.md differs from what it renders.

    python benchmarks/readme.py [--check] [--readme README.md] [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"

OPEN = re.compile(r"^<!-- results: (?P<name>\S+) -->$", re.MULTILINE)
BLOCK = re.compile(r"^<!-- results: (?P<name>\S+) -->\n(?P<body>.*?)^<!-- /results -->$",
                   re.MULTILINE | re.DOTALL)


class ReadmeError(Exception):
    """A block that cannot be rendered: unknown name, missing JSON, missing key."""


def load(results: Path, name: str) -> dict[str, Any]:
    """``results/NAME.json``, parsed; a missing file is a ``ReadmeError`` naming it."""
    path = results / f"{name}.json"
    if not path.is_file():
        raise ReadmeError(f"missing JSON file: {path}")
    return json.loads(path.read_text())


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table, one line per row, ending in a newline; an empty cell is ``| |``."""
    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|\n"

    return line(header) + "|" + "---|" * len(header) + "\n" + "".join(map(line, rows))


def x(value: float, digits: int = 2) -> str:
    """A ratio: ``1.28x``."""
    return f"{value:.{digits}f}x"


def pct(value: float) -> str:
    """A rate in [0, 1] as a percentage with one decimal."""
    return f"{100 * value:.1f}%"


# --- the default job ---------------------------------------------------------------------

EVAL = "eval/main/"
LEARNED = 0.1
"""Chips/hand against random above which a sweep run counts as learned (the failure mode
breaks even); such cells of the chosen config are bold."""
PREVIOUS_DEFAULT = (6, 1e-3)
"""(max_tokens, lr) of the default before the sweep: its row comes first."""


def _chips(ev: dict[str, Any], opponent: str, bold: bool = False) -> str:
    mean = ev.get(f"{EVAL}{opponent}/chips")
    if mean is None:
        return "—"
    cell = f"{mean:+.3f} ± {ev[f'{EVAL}{opponent}/ci95']:.3f}"
    return f"**{cell}**" if bold else cell


def render_default_job(results: Path) -> str:
    """The final table of the default job, seed 0: untrained (first eval) vs trained (last)."""
    run = load(results, "default_job")["runs"][0]
    first, last = run["first_eval"], run["last_eval"]
    hands = {o: int(last[f"{EVAL}{o}/hands"]) for o in ("vs_random", "vs_base")}
    rows = [
        [f"chips/hand vs random (95% CI, {hands['vs_random']} hands)",
         _chips(first, "vs_random"), _chips(last, "vs_random", bold=True)],
        ["invalid replies vs random"]
        + [pct(e[f"{EVAL}vs_random/invalid_rate"]) for e in (first, last)],
        [f"chips/hand vs base model (95% CI, {hands['vs_base']} hands)",
         _chips(first, "vs_base"), _chips(last, "vs_base")],
        ["exploitability (NashConv / 2)"]
        + [f"{e[EVAL + 'exploitability']:.3f}" for e in (first, last)],
        ["probability mass on the canonical replies"]
        + [f"{e[EVAL + 'canonical_mass']:.3f}" for e in (first, last)],
    ]
    header = ["metric", f"untrained (step {first[EVAL + 'version']})",
              f"trained (step {last[EVAL + 'version']})"]
    return table(header, rows)


def _lr(lr: float) -> str:
    """``3e-4``, not ``3e-04``."""
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def render_default_job_sweep(results: Path) -> str:
    """Every sweep run's chips/hand vs random: a row per config, a column per seed."""
    chosen = load(results, "default_job")["runs"][0]["config"]
    runs = load(results, "default_job_sweep")["runs"]

    def key(config: dict[str, Any]) -> tuple[int, float, float]:
        return config["max_tokens"], config["lr"], config["entropy_coef"]

    configs = sorted({key(r["config"]) for r in runs},
                     key=lambda k: (k[:2] != PREVIOUS_DEFAULT, k[0], -k[1], k[2]))
    seeds = sorted({r["seed"] for r in runs})
    rows = []
    for mt, lr, ent in configs:
        best = (mt, lr, ent) == key(chosen)
        lr_cell = f"**{_lr(lr)}**" if best else _lr(lr)
        if ent:
            lr_cell += f", `entropy_coef = {ent:g}`"
        row = [f"{mt} (the previous default)" if (mt, lr) == PREVIOUS_DEFAULT else str(mt),
               lr_cell]
        for seed in seeds:
            chips = [r["last_eval"][f"{EVAL}vs_random/chips"] for r in runs
                     if r["seed"] == seed and key(r["config"]) == (mt, lr, ent)]
            cells = list(dict.fromkeys(f"{c:+.3f}" for c in chips))
            bold = best and chips and min(chips) > LEARNED
            row.append(" / ".join(f"**{c}**" if bold else c for c in cells))
        rows.append(row)
    return table(["max_tokens", "lr", *(f"seed {s}" for s in seeds)], rows)


# --- benchmarks --------------------------------------------------------------------------

PACE_BACKENDS = {
    "single": "single-process loop (baseline: host called directly, no bus, no actors)",
    "local": 'the components over the bus in one process (`backend = "local"`)',
    "ray": "Ray actors over the bus (the default)",
}
RAY_COMPONENTS = ("scheduler", "env_runner", "learner", "coordinator")
WORDS = dict(enumerate(("zero", "one", "two", "three", "four", "five", "six", "seven")))


def render_pipeline_pace(results: Path) -> str:
    """Seconds per step and its phases per backend; then the CPU seconds per step."""
    data = load(results, "pipeline_pace")
    res = data["results"]
    phases = ("median_s", "rollout_s", "learn_s", "compute_s", "comm_s", "eval_s")
    steps = table(
        ["runtime", "s/step", "rollout", "learning", "compute", "comm", "eval",
         "vs single-process"],
        [[label, *(f"{res[b][p]:.2f}" for p in phases), x(res[b]["ratio"])]
         for b, label in PACE_BACKENDS.items()])
    single, local, ray = (res[b] for b in PACE_BACKENDS)
    (local_proc,) = local["cpu_s"]
    ray_cpu = ray["cpu_s"]
    daemons = sum(v for k, v in ray_cpu.items() if k not in RAY_COMPONENTS)
    cpu = table(
        ["CPU s per step", "single", "local", "Ray"],
        [["the model (scheduler, or the loop's process)",
          f"{sum(single['cpu_s'].values()):.2f}",
          f"{local['cpu_s'][local_proc]:.2f} (all {WORDS[len(local_proc.split('+'))]} components)",
          f"{ray_cpu['scheduler']:.2f}"],
         [f"env runners ({ray['processes']['env_runner']}) / learner / coordinator", "", "",
          " / ".join(f"{ray_cpu[k]:.2f}" for k in RAY_COMPONENTS[1:])],
         ["Ray's daemons (raylet, gcs_server, log monitor) and the driver", "", "",
          f"{daemons:.2f}"],
         [f"total (share of {data['provenance']['cores']} cores x wall)",
          *(f"{r['cpu_total_s']:.2f} ({r['cpu_util']:.0%})" for r in (single, local, ray))]])
    return steps + "\n" + cpu


THREAD_BUSY = {"idle": "nothing", "python": "one busy Python process",
               "torch": "one 2-thread torch process"}
THREAD_SETTINGS = {"1 thread": "1 thread",
                   "2 threads, libgomp default": "2 threads, libgomp's default",
                   "2 threads, GOMP_SPINCOUNT=1000": "2 threads, `GOMP_SPINCOUNT=1000`"}


def render_threads(results: Path, rows: int = 32) -> str:
    """ms per decode-sized linear (``rows`` rows) per thread setting, beside each load."""
    by = {(r["busy"], r["setting"]): r["ms_per_linear"]
          for r in load(results, "threads")["rows"] if r["rows"] == rows}
    return table(["beside it", *THREAD_SETTINGS.values()],
                 [[label, *(f"{by[busy, s]:.3f} ms" for s in THREAD_SETTINGS)]
                  for busy, label in THREAD_BUSY.items()])


MULTIPLEX_METHODS = {  # method: (label in the first batch's rows, label after)
    "engine": (("the engine (continuous batching, batched LoRA `bgmv` on the slot store, "
                "own forward)"), "the engine"),
    "peft_mixed": ("PEFT's mixed-adapter batch (the path before the engine; baseline)",
                   "PEFT's mixed-adapter batch"),
    "swap": ("one adapter at a time (PEFT)",) * 2,
    "copies": ("K model copies, one adapter each (engine)",) * 2,
}


def render_multiplex(results: Path) -> str:
    """tokens/s per K, ratio to PEFT's mixed batch, peak RSS and memory ratio, per batch."""
    data = load(results, "multiplex")["rows"]
    by = {(r["method"], r["batch"], r["K"]): r for r in data}
    ks = sorted({r["K"] for r in data})
    batches = sorted({r["batch"] for r in data})
    top = ks[-1]
    header = ["method", "batch", f"K={ks[0]} tokens/s", *(f"K={k}" for k in ks[1:]),
              f"vs PEFT mixed at K={top}", f"peak RSS at K={top}",
              "mem ratio at K=" + " / ".join(map(str, ks))]
    rows = []
    for i, batch in enumerate(batches):
        for method, labels in MULTIPLEX_METHODS.items():
            cells = [by[method, batch, k] for k in ks]
            mem = (" / ".join(f"{c['mem_ratio']:.2f}" for c in cells)
                   if "mem_ratio" in cells[0] else "")
            rows.append([labels[min(i, 1)], str(batch),
                         *(f"{c['tokens_per_s']:.1f}" for c in cells),
                         x(cells[-1]["vs_peft_mixed"]),
                         f"{cells[-1]['peak_bytes'] / 2**30:.2f} GiB", mem])
    return table(header, rows)


def render_engine_overhead(results: Path) -> str:
    """Ops and time of one decode step per model, LoRA method, batch and adapter count."""
    data = load(results, "engine_overhead")["rows"]
    header = ["model", "LoRA", "batch", "adapters", "ops dispatched", "ATen ops (composites included)",
              "step ms", "decode tokens/s", "vs `bgmv`"]
    labels = {"slots": "fused ops (now)", "bgmv": "`bgmv` stacks (before; baseline)"}
    rows = [[r["model"], labels.get(r["method"], r["method"]), str(r["batch"]), str(r["adapters"]), str(r["ops"]),
             str(r["aten_ops"]), f"{r['step_ms']:.1f}", f"{r['decode_tokens_per_s']:.0f}",
             x(r.get("speedup_vs_bgmv", 1.0))] for r in data]
    return table(header, rows)


ROLLOUT_JOBS = {
    "default": "default (Kuhn poker, {episodes:.0f} hands, {reply:.0f}-token replies)",
    "negotiation": "negotiation ({episodes:.0f} episodes, ~{turns:.0f} LLM turns)",
}
ROLLOUT_PATHS = {"before": "PEFT (before)", "engine": "engine"}


def render_rollout(results: Path) -> str:
    """Seconds per rollout phase and prompt tokens computed per turn, per job and path."""
    data = load(results, "rollout")["rows"]
    rows = []
    for job, fmt in ROLLOUT_JOBS.items():
        mine = [r for r in data if r["job"] == job]
        steps = mine[0]["steps"]
        label = fmt.format(episodes=mine[0]["episodes"] / steps,
                           reply=mine[0]["reply_tokens_per_turn"],
                           turns=sum(r["llm_turns"] for r in mine) / len(mine) / steps)
        for path, name in ROLLOUT_PATHS.items():
            (r,) = (r for r in mine if r["path"] == path)
            rows.append([label, name, f"{r['s_per_step']:.2f}", x(r["speedup"]),
                         f"{r['prefill_tokens_per_turn']:.1f}",
                         f"{r['new_tokens_per_turn']:.1f}", f"{r['prefill_over_new']:.2f}"])
    return table(["job", "path", "s/step", "speedup", "prompt tokens computed per turn",
                  "new tokens per turn", "computed / new"], rows)


def render_shared_forward(results: Path) -> str:
    """One ``forward_backward``: plain padded batch against the shared one."""
    d = load(results, "shared_forward")
    return table(["method", "median s", "ratio"], [
        ["plain padded batch (what a PEFT training loop does)", f"{d['plain_s']:.2f}", "1.00"],
        ["shared prefix, shared contexts, deduplicated sequences, loss positions only",
         f"{d['shared_s']:.2f}", f"{d['speedup']:.2f}x faster"]])


BUS_KINDS = {
    "raw_zmq": "raw pyzmq DEALER/ROUTER echo, same frames, no security (baseline)",
    "raw_zmq_plain": "raw pyzmq echo behind PLAIN + a ZAP handler",
    "raw_zmq_curve": "raw pyzmq echo behind CURVE",
    "bus_sync": "this bus, `SyncClient` (PLAIN, the default)",
    "bus_async": "this bus, asyncio `Client` (PLAIN)",
    "bus_async_park": "this bus, asyncio `Client(spin_s=0)` (never polls; PLAIN)",
    "bus_sync_curve": "this bus, `SyncClient` with CURVE keys",
    "ray": "Ray actor call",
}


def render_bus(results: Path, transport: str = "ipc") -> str:
    """Round trips per client over ``transport`` (Ray's own for the Ray row)."""
    by = {(r["kind"], r["payload"]): r for r in load(results, "bus")["results"]
          if r["transport"] in (transport, "ray")}
    rows = []
    for kind, label in BUS_KINDS.items():
        small, big = by[kind, "small"], by[kind, "1MiB"]
        connect = small["connect_us"]
        rows.append([label, f"{small['p50_us']:.0f} µs", x(small["vs_raw_zmq"]),
                     x(small["ray_p50_over_this"], 1), f"{small['cpu_us']:.0f} µs",
                     f"{big['p50_us']:.0f} µs", f"{big['msgs_per_s']:.0f}",
                     x(big["throughput_vs_raw_zmq"]),
                     "—" if connect is None else f"{connect:.0f} µs"])
    return table(["client", "small p50", "vs raw pyzmq", "Ray call p50 / this",
                  "client CPU per round trip", "1 MiB p50", "1 MiB msgs/s (32 in flight)",
                  "raw pyzmq's msgs/s / this", "connect"], rows)


CODEC_MESSAGES = {"1 MiB array": "`LogprobsResult`, one 1 MiB array",
                  "16 prompts": "`SampleRequest`, 16 prompts",
                  "64 datums x 4 arrays": "`ForwardBackward`, 64 datums x 4 arrays"}


def _us(value: float) -> str:
    """µs: one decimal below 100, whole above."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def render_codec(results: Path) -> str:
    """Median µs to encode and decode each message, and pickle 5's."""
    by = {r["message"]: r for r in load(results, "codec")["results"]}
    rows = [[label, str(r["arrays"]),
             f"{_us(r['encode_us'])} ({r['encode_vs_pickle']:.2f}x)", _us(r["pickle_encode_us"]),
             f"{_us(r['decode_us'])} ({r['decode_vs_pickle']:.2f}x)", _us(r["pickle_decode_us"])]
            for message, label in CODEC_MESSAGES.items() for r in [by[message]]]
    return table(["message", "arrays", "encode", "pickle", "decode", "pickle"], rows)


# --- whole jobs: the default job's time per machine, learners, LoRA against full --------

DEFAULT_JOB_FILES = ("default_job", "default_job_20261201", "default_job_rerun", "default_job_twins")
"""The default job's runs (its config as shipped at the time), each recording its machine."""


def _machine_label(m: dict[str, Any] | None) -> str:
    """``AMD EPYC, 2 cores, AVX2 kernels (forced: ATEN_CPU_CAPABILITY=avx2 ...)``."""
    if not m:
        return "not recorded"
    forced = [f"{k}={m['env'][k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in m.get("env", {})]
    cap = m.get("cpu_capability") or m.get("capability")
    return f"{m['cpu']}, {m['cores']} cores, {cap} kernels" + (f" (forced: {' '.join(forced)})" if forced else "")


def render_default_job_times(results: Path) -> str:
    """A line per machine: the default job's runs on it and their time from start to summary."""
    by: dict[str, list[tuple[str, int, float]]] = {}
    for name in DEFAULT_JOB_FILES:
        for run in load(results, name)["runs"]:
            by.setdefault(_machine_label(run.get("machine")), []).append((name, run["seed"], run["wall_s"]))
    rows = []
    for label, runs in by.items():
        walls = [w for _, _, w in runs]
        files = ", ".join(dict.fromkeys(f"`{n}.json`" for n, _, _ in runs))
        rows.append([label, str(len(runs)), f"{min(walls) / 60:.1f}-{max(walls) / 60:.1f} min",
                     f"{sorted(walls)[len(walls) // 2] / 60:.1f} min", files])
    return table(["machine", "runs", "start to summary", "median", "from"], rows)


def render_compare_learners(results: Path) -> str:
    """The comparison's table (from its per-learner summary), what it ran on, its verdict."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compare_learners as cl

    import games

    r = load(results, "compare_learners")
    args = cl.Args(**{k: v for k, v in r["args"].items() if k in cl.Args.__dataclass_fields__})
    ev = games.evaluation(r["game"])
    p = r["provenance"]
    seeds = len(args.seeds.split(","))
    head = (f"{r['game']}, {seeds} seeds, {args.steps * args.groups_per_step * args.group_size} episodes per "
            f"learner; {_machine_label({**p, 'cpu_capability': p['capability']})}; "
            f"{r['wall_s'] / 60:.0f} min in all (commit `{p['commit'][:7]}`: `{p['command']}`)\n\n")
    return head + cl.table_md(r["summary"], ev, args) + "\n\n" + cl.verdict(r["summary"], ev) + "\n"


LVF_COLUMNS = (("s_per_step", "s/step", "{:.2f}"), ("learn_s_per_step", "learn s/step", "{:.2f}"),
               ("peak_rss_largest_mb", "peak RSS, scheduler", "{:.0f} MB"),
               ("peak_rss_total_mb", "peak RSS, all processes", "{:.0f} MB"),
               ("train_tokens_per_s", "loss tokens/s", "{:.0f}"), ("decode_tokens_per_s", "sampled tokens/s", "{:.0f}"))


def lora_vs_full_claim(ratios: dict[str, Any]) -> str:
    """The script's own verdict on the paper's claim, from the ratios (``lora_vs_full.claim``)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import lora_vs_full

    return lora_vs_full.claim(ratios)


def render_lora_vs_full(results: Path, name: str = "lora_vs_full") -> str:
    """Mean over seeds per kind, the full / LoRA ratios, and whether the paper's claim holds."""
    r = load(results, name)
    unit = r["unit"]
    warm = bool(r["args"].get("warm"))
    rows = []
    for kind in ("lora", "full"):
        mine = [row for row in r["rows"] if row["kind"] == kind]
        finals = [f"{row['final'][unit]:+.3f}" + ("" if row["final"]["ci95"] is None else f" ± {row['final']['ci95']:.3f}")
                  for row in mine]
        reach = [row["wall_s_to_target"] for row in mine]
        cells = [kind, ", ".join(finals),
                 ", ".join("never" if w is None else f"{w:.0f} s" for w in reach),
                 ", ".join("never" if row["episodes_to_target"] is None else str(row["episodes_to_target"])
                           for row in mine)]
        cells += [fmt.format(sum(row[k] for row in mine) / len(mine)) for k, _, fmt in LVF_COLUMNS]
        if warm:
            cells.append(", ".join(f"{row['sft']['loss_first']:.3f} -> {row['sft']['loss_last']:.4f} in "
                                   f"{row['sft']['train_wall_s']:.0f} s" for row in mine))
        rows.append(cells)
    ratio = r["ratios"]
    rows.append(["full / LoRA", "", x(ratio["wall_s_to_target"]["mean"]) if "wall_s_to_target" in ratio else "n/a", ""]
                + [x(ratio[k]["mean"]) if k in ratio else "n/a" for k, _, _ in LVF_COLUMNS] + ([""] if warm else []))
    header = ["kind", f"final {unit} vs random (per seed, 95% CI)", f"time to {r['args']['target']:+g}"
              + (" (SFT included)" if warm else ""), "episodes to it", *(label for _, label, _ in LVF_COLUMNS)]
    header += ["SFT: loss on the data, time (per seed)"] if warm else []
    p = r["provenance"]
    seeds = {k: sorted({row["seed"] for row in r["rows"] if row["kind"] == k}) for k in ("lora", "full")}
    said = (f"{len(seeds['lora'])} seeds" if seeds["lora"] == seeds["full"] else
            f"seeds {', '.join(map(str, seeds['lora']))} with LoRA, {', '.join(map(str, seeds['full']))} with full training")
    head = (f"`{r['game']}`, {said}, " + ("each kind from its own SFT job, then " if warm else "")
            + f"{r['args']['steps']} steps of {r['args']['groups_per_step'] * r['args']['group_size']} episodes; "
            f"{_machine_label({**p, 'cpu_capability': p['capability']})}; "
            f"{r.get('runs_wall_s', r['wall_s']) / 60:.0f} min in all "
            f"(commit `{p['commit'][:7]}`: `{p['command']}`)\n\n")
    return head + table(header, rows) + "\n" + lora_vs_full_claim(r["ratios"]) + "\n"


def render_tools_job(results: Path) -> str:
    """The bundled ``tools`` job per seed (the LoRA runs of ``lora_vs_full_tools.json``): the
    success rate at every evaluation, at the end with its 95% interval, tool calls and invalid
    calls per problem at the end, the wall time; then the scripted seats on the same task."""
    r = load(results, "lora_vs_full_tools")
    unit = r["unit"]

    def rate(value: float, ci: float | None) -> str:
        return f"{value:.3f}" + ("" if ci is None else f" ± {ci:.3f}")

    rows = []
    for row in (row for row in r["rows"] if row["kind"] == "lora"):
        f = row["final"]
        curve = ", ".join(f"{c[unit]:.3f} ({c['step']})" for c in row["curve"])
        rows.append([str(row["seed"]), curve, rate(f[unit], f["ci95"]), f"{f.get('tool_calls', 0):.2f}",
                     f"{f.get('invalid_tool_calls', 0):.2f}", f"{row['wall_s'] / 60:.1f} min"])
    for name, b in r.get("scripted", {}).items():
        rows.append([f"scripted `{name}`", "", rate(b[unit], b["ci95"]), f"{b['tool_calls']:.2f}", "", ""])
    p = r["provenance"]
    head = (f"`{r['game']}`, {r['args']['steps']} steps of {r['args']['groups_per_step'] * r['args']['group_size']} "
            f"problems, evaluated on {int(r['rows'][0]['final']['hands'])} problems; "
            f"{_machine_label({**p, 'cpu_capability': p['capability']})}"
            + (f"; {r['args']['note']}" if r["args"].get("note") else "") + "\n\n")
    header = ["seed", f"{unit} at each evaluation (step)", f"{unit} at the end (95% CI)", "tool calls / problem",
              "invalid calls / problem", "wall time"]
    return head + table(header, rows)


def render_learning_suite(results: Path, name: str = "learning_suite") -> str:
    """``learning_suite.json``: per job, seed and policy, the final evaluation against random,
    the base model and each scripted seat (95% intervals), wins / draws / losses against
    random where the game counts them, the invalid rate, the gain over the untrained policy,
    the run's wall time and the scheduler's peak; then each job's verdict."""
    r = load(results, name)

    def ci(m: dict[str, Any] | None, unit: str) -> str:
        return "—" if m is None else f"{m[unit]:+.3f} ± {m['ci95']:.3f}"

    rows = []
    for row in r["rows"]:
        unit = row["unit"]
        for policy, final in row["final"].items():
            rnd, ok = final.get("random"), row["learned"].get(policy, {})
            scripted = ", ".join(f"`{o}` {ci(m, unit)}" for o, m in final.items() if o not in ("random", "base"))
            wdl = "/".join(f"{int(rnd[k])}" for k in ("wins", "draws", "losses")) if rnd and "wins" in rnd else "—"
            gain = f"{ok['gain_vs_untrained']:+.3f} ± {ok['gain_ci95']:.3f}" if ok else "—"
            rows.append([f"`{row['job']}`" + (f" {policy}" if len(row["final"]) > 1 else ""), str(row["seed"]),
                         ci(rnd, unit), wdl, ci(final.get("base"), unit), scripted or "—",
                         pct(rnd["invalid_rate"]) if rnd else "—", gain,
                         f"{row['wall_s'] / 60:.1f} min", f"{row['scheduler_peak_rss_mb']:.0f} MB",
                         _machine_label(row.get("machine"))])
    head = (f"{', '.join(sorted({row['model'] for row in r['rows']}))}"
            + (f"; {r['note']}" if r.get("note") else "") + "\n\n")
    header = ["job", "seed", "vs random (95% CI)", "W/D/L vs random", "vs base", "vs scripted seats",
              "invalid", "gain over untrained", "wall time", "scheduler peak", "machine"]
    verdict = "\n".join(
        f"- `{job}` (seeds {', '.join(map(str, v['seeds']))}): "
        + ("learned on every seed" if v["every_seed"] else "did not learn on every seed")
        + ("" if "target_every_seed" not in v else "; target " + (
            "met on every seed" if v["target_every_seed"] else "not met on every seed"))
        + ("" if "ratings_settled" not in v else "; ratings " + (
            "settled (the last two evaluations' intervals overlap)" if v["ratings_settled"] else "still moving"))
        + f"; scheduler peak {v['scheduler_peak_mb']:.0f} MB ("
        + ("under" if v.get("scheduler_under_budget") else "over") + " 4 GB)"
        for job, v in r["verdicts"].items())
    targets = "\n".join(_suite_target(row, r["targets"][row["job"]]) for row in r["rows"] if "target" in row)
    scripted = "\n".join(
        f"- `{job}`: " + ", ".join(f"`{pair.split(' with ')[0]}` with {pair.split(' with ')[1]} "
                                   f"{m['mean']:+.3f} ± {m['ci95']:.3f}" for pair, m in refs.items())
        for job, refs in r.get("scripted", {}).items() if refs)
    beside = "\n".join(
        f"- `{job}` with `{c['partner']}`: trained {c['trained_mean']:+.3f} ("
        + ", ".join(f"{x:+.3f}" for x in c["trained"]) + f"), `{c['seat']}` in its place {c['scripted']:+.3f}"
        for job, cs in r.get("beside_scripted", {}).items() for c in cs)
    return (head + table(header, rows) + "\n" + verdict + "\n" + (f"\nTargets:\n\n{targets}\n" if targets else "")
            + (f"\nWhat the scripted seats score (with themselves and with random, 400 games each, seats "
               f"alternating):\n\n{scripted}\n" if scripted else "")
            + (f"\nHow close the trained policies come to the scripted seats: their final scores with a partner "
               f"(the mean, then each seed's and policy's) beside the scripted seat's score with the same "
               f"partner:\n\n{beside}\n" if beside else ""))


def _suite_target(row: dict[str, Any], target: dict[str, Any]) -> str:
    """A seed's line of the suite's targets: each check's value beside its threshold."""
    checks = row["target"]
    parts = []
    for key, value in checks.items():
        if key.endswith("/vs_random"):
            parts.append(f"{key.split('/')[0]} {value:+.3f} against random (target {target['vs_random']:+.2f})")
        elif key.endswith("/vs_random_exact"):
            parts.append(f"exactly {value:+.3f} (`{target['exact_vs_random']}`: decides)")
        elif "/drawn_vs_" in key:
            parts.append(f"{pct(value)} of games against `{target['drawn_vs']}` drawn (target {pct(target['drawn'])})")
        elif key == "minutes":
            parts.append(f"{value:.1f} min (target {target['minutes']:.0f})")
    return (f"- `{row['job']}` seed {row['seed']}: " + ", ".join(parts) + ": "
            + ("met" if checks["met"] else "not met") + f" ({target['anchor']})")


def render_tictactoe_runs(results: Path) -> str:
    """``tictactoe_runs.json`` (``collect_runs.py``): per run its settings, the score against
    random at every evaluation, the last evaluation against random (95% CI, invalid rate)
    and against minimax (games drawn), its steps and time."""
    r = load(results, "tictactoe_runs")
    rows = []
    for run in r["runs"]:
        c, last = run["config"], run["last_eval"]
        k = "eval/main/vs_random/"
        m = "eval/main/vs_tictactoe_minimax/"
        settings = (f"{c['groups_per_step']}x{c['group_size']} episodes, lr {c['lr']:g}, explore {c['explore']:g}, "
                    f"max_tokens {c['max_tokens']}" + (", brief" if c["game_kwargs"].get("brief") else "")
                    + (", opponent_draws group" if c["opponent_draws"] == "group" else "")
                    + (f", entropy_coef {c['entropy_coef']:g}" if c.get("entropy_coef") else ""))
        curve = ", ".join(f"{e[k + 'score']:+.3f} ({e['step']})" for e in run["curve"])
        games = sum(last[m + x] for x in ("wins", "draws", "losses"))
        time = (f"{run['wall_s'] / 60:.1f} min" if run["finished"]
                else f"stopped: {run['steps_and_evals_s'] / 60:.1f} min of steps and evaluations")
        rows.append([settings, curve, f"{last[k + 'score']:+.3f} ± {last[k + 'ci95']:.3f}",
                     pct(last[k + "invalid_rate"]), f"{int(last[m + 'draws'])} of {int(games)}",
                     str(run["steps"]), time])
    machines = sorted({_machine_label(run["machine"]) for run in r["runs"] if run.get("machine")})
    head = (f"{'; '.join(machines)}; seed 0" + (f"; {r['note']}" if r.get("note") else "") + "\n\n")
    header = ["settings", "score vs random at each evaluation (step)", "last vs random (95% CI)", "invalid",
              "drawn vs minimax", "steps", "time"]
    return head + table(header, rows)


def render_league_runs(results: Path, name: str) -> str:
    """A league job's runs (``collect_runs.py``, e.g. ``leduc_league.json``): per run and
    policy the exact measure (the exploitability) before training, every tenth training step
    and at the final evaluation, the mass on the canonical replies, the final score against
    random, the steps, time, scheduler peak and machine."""
    r = load(results, name)
    rows = []
    for run in r["runs"]:
        first, last = run["first_eval"], run["last_eval"]
        for key in sorted(k for k in last if k.startswith("eval/") and k.endswith("/exploitability")):
            policy = key.split("/")[1]
            steps = [row for row in run["exact_curve"] if row["step"] % 10 == 0 and f"train/{policy}/exploitability" in row]
            curve = ", ".join([f"{first[key]:.3f} (0)"] + [f"{row[f'train/{policy}/exploitability']:.3f} ({row['step']})"
                                                           for row in steps])
            score = f"eval/{policy}/vs_random/{run['unit']}"
            time = f"{run['wall_s'] / 60:.1f} min" if run["finished"] else "stopped"
            peak = f"{run['scheduler_peak_rss_mb']:.0f} MB" if run.get("scheduler_peak_rss_mb") else "—"
            rows.append([f"`{run['game']}` {policy}", curve, f"{last[key]:.3f}",
                         f"{last[f'eval/{policy}/canonical_mass']:.3f}",
                         f"{last[score]:+.3f} ± {last[f'eval/{policy}/vs_random/ci95']:.3f}",
                         str(run["steps"]), time, peak, _machine_label(run.get("machine"))])
    head = f"{r['note']}\n\n" if r.get("note") else ""
    header = ["run", "exploitability at the start of a step (step)", "final exploitability", "canonical mass",
              "final vs random (95% CI)", "steps", "time", "scheduler peak", "machine"]
    return head + table(header, rows)


TOOLS_FAILURES = {"invalid_call": "invalid call", "no_number": "no number", "wrong_after_call": "result miscopied",
                  "wrong_without_call": "wrong without a call"}
"""``tools_warm_start.json``'s kinds of unsolved training problem, as the table names them."""


def render_tools_warm_start(results: Path) -> str:
    """``tools_sft`` then ``tools_warm`` per seed (``tools_warm_start.json``): the SFT job's loss
    on its data and time, the RL job's success at every evaluation (step 0: the SFT adapter),
    at the end with its 95% interval, tool and invalid calls per problem at the end, its time;
    then the commands and what they ran on."""
    r = load(results, "tools_warm_start")
    unit = r["unit"]
    rows = []
    for row in r["rows"]:
        s, rl = row["sft"], row["rl"]
        f = rl["final"]
        curve = ", ".join(f"{c[unit]:.3f} ({c['step']})" for c in rl["curve"])
        tf = rl["training_failures"]
        failed = (f"{tf['failed']} of {tf['problems']}: " + ", ".join(
            f"{tf[k]} {label}" for k, label in TOOLS_FAILURES.items() if tf[k]) if tf["failed"] else f"0 of {tf['problems']}")
        alone = "" if not s.get("eval") else f"{s['eval'][unit]:.3f} ± {s['eval']['ci95']:.3f} ({int(s['eval']['hands'])})"
        rows.append([str(row["seed"]), f"{s['loss_before']:.3f} → {s['loss_after']:.4f}", f"{s['wall_s'] / 60:.1f} min",
                     alone, curve, f"{f[unit]:.3f} ± {f['ci95']:.3f}", f"{f.get('tool_calls', 0):.2f}",
                     f"{f.get('invalid_tool_calls', 0):.2f}", failed, f"{rl['wall_s'] / 60:.1f} min"])
    p = r["provenance"]
    first = r["rows"][0]
    head = (f"`{r['game']}`: SFT on {first['sft']['sequences']} of `calc_tool_user`'s problems for "
            f"{first['sft']['steps']} steps, then {first['rl']['steps']} RL steps of "
            f"{first['rl']['curve'][1]['episodes'] // first['rl']['curve'][1]['step']} problems, evaluated on "
            f"{int(first['rl']['final']['hands'])} problems; {_machine_label({**p, 'cpu_capability': p['capability']})}"
            f"; commit `{p['commit'][:7]}`" + (f"; {r['args']['note']}" if r["args"].get("note") else "") + "\n\n")
    header = ["seed", "SFT loss on its data", "SFT wall time", f"SFT adapter's {unit} (95% CI, problems)",
              f"RL: {unit} at each evaluation (step; 0: the SFT adapter)",
              f"{unit} at the end (95% CI)", "tool calls / problem", "invalid calls / problem",
              "RL training problems unsolved", "RL wall time"]
    commands = "".join(f"- seed {row['seed']}: `{row['sft']['command']}`; "
                       + (f"`{row['sft']['eval']['command']}`; " if row["sft"].get("eval") else "")
                       + f"`{row['rl']['command']}`\n" for row in r["rows"])
    return head + table(header, rows) + "\n" + commands


RENDERERS: dict[str, Callable[[Path], str]] = {
    "default_job_times": render_default_job_times,
    "compare_learners": render_compare_learners,
    "lora_vs_full": render_lora_vs_full,
    "lora_vs_full_tools": lambda results: render_lora_vs_full(results, "lora_vs_full_tools"),
    "lora_vs_full_tools_warm": lambda results: render_lora_vs_full(results, "lora_vs_full_tools_warm"),
    "tools_job": render_tools_job,
    "learning_suite": render_learning_suite,
    "tictactoe_runs": render_tictactoe_runs,
    "learning_suite_explore0": lambda results: render_learning_suite(results, "learning_suite_explore0"),
    "tools_warm_start": render_tools_warm_start,
    "leduc_league": lambda results: render_league_runs(results, "leduc_league"),
    "default_job": render_default_job,
    "default_job_sweep": render_default_job_sweep,
    "pipeline_pace": render_pipeline_pace,
    "threads": render_threads,
    "multiplex": render_multiplex,
    "engine_overhead": render_engine_overhead,
    "rollout": render_rollout,
    "shared_forward": render_shared_forward,
    "bus": render_bus,
    "codec": render_codec,
}


# --- the README --------------------------------------------------------------------------

def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every block's body replaced by what its renderer returns."""
    opened = [m["name"] for m in OPEN.finditer(text)]
    closed = [m["name"] for m in BLOCK.finditer(text)]
    if opened != closed:
        raise ReadmeError(f"unclosed block(s): {sorted(set(opened) - set(closed))}")

    def body(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in RENDERERS:
            raise ReadmeError(f"unknown block name: {name!r} (known: {', '.join(RENDERERS)})")
        try:
            rendered = RENDERERS[name](results)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ReadmeError(f"block {name!r}: {type(e).__name__}: {e}") from e
        return f"<!-- results: {name} -->\n{rendered}<!-- /results -->"

    return BLOCK.sub(body, text)


def check(readme: Path = README, results: Path = RESULTS) -> str:
    """A unified diff from ``readme`` to what it renders; empty when they agree."""
    text = readme.read_text()
    return "".join(difflib.unified_diff(
        text.splitlines(keepends=True), render(text, results).splitlines(keepends=True),
        fromfile=str(readme), tofile=f"{readme} (rendered from {results})"))


def write(readme: Path = README, results: Path = RESULTS) -> bool:
    """Rewrite ``readme``'s blocks in place; whether anything changed."""
    text = readme.read_text()
    new = render(text, results)
    if new != text:
        readme.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="print a diff and exit 1 if README differs from its JSON")
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    try:
        if args.check:
            diff = check(args.readme, args.results)
            sys.stdout.write(diff)
            return 1 if diff else 0
        print(f"{args.readme}: {'updated' if write(args.readme, args.results) else 'unchanged'}")
    except ReadmeError as e:
        print(f"readme.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
