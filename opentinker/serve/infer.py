"""``opentinker infer PROMPTS --out FILE``: batch inference with a saved adapter (or the bare
base model) on the scheduler, the same sampling the OpenAI endpoint and training use.

``PROMPTS`` is JSON Lines, one request per line: ``{"messages": [{"role": ..., "content":
...}, ...]}`` (rendered by the model's chat template, as ``/v1/chat/completions`` does) or
``{"prompt": "text"}`` (encoded as is, as ``/v1/completions``), with an optional ``"id"`` (a
string or an integer; default: the line number). Every line is read and checked before
anything is sampled: a bad line is an error naming its number, and nothing is written.

Each line's reply is drawn with seed ``--seed + i`` (``i``: its index in the file), so a line's
reply does not depend on the batch it went in; ``--temperature 0`` is greedy. The tokenizer's
eos ends a reply (drawn, but in neither the text nor the log-probs). ``--out`` gets one JSON
line per prompt, in the file's order: ``id``, ``text``, ``finish_reason`` (``stop`` or
``length``), ``tokens`` and ``logprobs`` (the sampler's, of each drawn token), ``prompt_tokens``,
``model`` (the adapter's name or ``base``) and ``adapter_version``. It is written to a
temporary file beside ``--out`` and linked to ``--out`` when every line is done; an existing
``--out`` is never replaced.

``--scheduler ADDRESS`` runs on a shared scheduler (``opentinker serve``) as a job of its own,
and a job queued with ``opentinker jobs submit --infer PROMPTS`` runs this command there.
Without it the command starts a scheduler in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

if TYPE_CHECKING:
    from opentinker.bus.sync import SyncClient
    from opentinker.config import JobConfig
    from opentinker.control.runtime import Job
    from opentinker.control.sources import Source
    from opentinker.rollout.render import ChatTokenizer
    from protocols.messages import SamplingParams

MAX_LINES = 1_000_000
MAX_TOKENS = 4096
"""The most prompts a file may hold, and the most tokens a reply may have."""


class InferError(ValueError):
    """What ``opentinker infer`` says on one line before exiting with status 2."""


@dataclass(frozen=True)
class Prompt:
    id: str | int
    tokens: np.ndarray
    """``int32[T]``: the rendered prompt."""


def read_prompts(path: str, tok: Any, room: int) -> list[Prompt]:
    """Every line of ``path`` as a :class:`Prompt`; :class:`InferError` naming the line of the
    first that is not JSON, has neither or both of ``messages`` and ``prompt``, is empty, or
    is longer than ``room`` tokens (the model's context less the reply's)."""
    try:
        lines = Path(path).read_text().split("\n")  # not splitlines: U+2028 and the like may stand in a JSON string
    except (OSError, UnicodeDecodeError) as e:
        raise InferError(f"{path}: {e}") from None
    if len(lines) > MAX_LINES:
        raise InferError(f"{path}: {len(lines)} lines, at most {MAX_LINES}")
    out, ids = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        try:
            raw = json.loads(line)
        except ValueError as e:
            raise InferError(f"{where}: not JSON ({e})") from None
        except RecursionError:  # 10,000 nested arrays ended in a traceback
            raise InferError(f"{where}: not JSON this reader takes (nested too deep)") from None
        if not isinstance(raw, dict) or ("messages" in raw) == ("prompt" in raw):
            raise InferError(f'{where}: an object with "messages" (a chat) or "prompt" (a text), one of the two')
        pid = raw.get("id", n)
        if not isinstance(pid, (str, int)) or isinstance(pid, bool) or pid in ids:
            raise InferError(f"{where}: id {pid!r} is not a string or an integer, or is not unique")
        ids.add(pid)
        if "prompt" in raw:
            if not isinstance(raw["prompt"], str) or not raw["prompt"]:
                raise InferError(f'{where}: "prompt" must be a non-empty string')
            text = raw["prompt"]
        else:
            msgs = raw["messages"]
            if not (isinstance(msgs, list) and msgs and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs)):
                raise InferError(f'{where}: "messages" must be a non-empty list of {{"role": str, "content": str}}')
            try:
                text = tok.render([{"role": m["role"], "content": m["content"]} for m in msgs],
                                  add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - the model's chat template refused these messages
                raise InferError(f"{where}: the chat template refused the messages: {e}") from None
        tokens = np.asarray(tok.encode(text), np.int32)
        if not 0 < len(tokens) <= room:
            raise InferError(f"{where}: the prompt is {len(tokens)} tokens; the model has room for 1 to {room} "
                             "with the reply's --max-tokens")
        out.append(Prompt(pid, tokens))
    if not out:
        raise InferError(f"{path}: no prompts")
    return out


def infer(args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    """Run what ``args`` describe (see the module docstring); returns the summary: rows,
    tokens drawn, wall time, tokens per second and the machine. ``progress(done, total)``
    after each batch."""
    from opentinker.bus.sync import SyncClient
    from opentinker.machine import job_machine
    from opentinker.rollout.render import ChatTokenizer
    from opentinker.serve.detokenize import reply_params
    from opentinker.serve.queue import read_model_config

    t0 = time.perf_counter()
    out = _check_args(args)
    source, model, model_path = _model_of(args)
    tok = ChatTokenizer(model_path)
    context = int(read_model_config(model_path).get("max_position_embeddings") or 2048)
    if args.max_tokens >= context:
        raise InferError(f"--max-tokens {args.max_tokens}: the model's context is {context} tokens, prompt included")
    prompts = read_prompts(args.prompts, tok, context - args.max_tokens)
    params = reply_params(args.temperature, args.top_p, 0, args.max_tokens, tok.eos_id, args.seed)
    with tempfile.TemporaryDirectory(prefix="opentinker-infer-") as tmp:
        cfg, job = _start_job(args, model, model_path, tmp)
        partial = None
        try:
            with SyncClient(job.scheduler_endpoint, "infer", credentials=job.scheduler_credentials) as client:
                name = None if source is None else _load_adapter(client, args.adapter, source, Path(tmp))
                fd, partial_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
                partial = Path(partial_name)
                with os.fdopen(fd, "w") as f:
                    drawn = _write_replies(client, f, _Batches(args, tok, prompts, params, name), progress)
            try:
                os.link(partial, out)  # never replaces a file (one made since the check above)
            except FileExistsError:
                raise InferError(f"--out {out}: already exists (nothing is replaced)") from None
        finally:
            if partial is not None:
                partial.unlink(missing_ok=True)
            job.shutdown()
    wall = time.perf_counter() - t0
    return {"prompts": args.prompts, "out": str(out), "rows": len(prompts), "tokens_drawn": drawn,
            "model": model, "adapter": args.adapter or "", "wall_s": wall, "tokens_per_s": drawn / max(wall, 1e-9),
            "machine": job_machine(cfg.model)}


def _check_args(args: argparse.Namespace) -> Path:
    """``--out`` (new, in a folder that exists) and the sampling options, checked before
    anything is read; :class:`InferError` naming the first that is wrong."""
    out = Path(args.out)
    if out.exists():
        raise InferError(f"--out {out}: already exists (nothing is replaced)")
    if not out.parent.is_dir():
        raise InferError(f"--out {out}: its folder does not exist")
    if not 1 <= args.max_tokens <= MAX_TOKENS:
        raise InferError(f"--max-tokens: between 1 and {MAX_TOKENS}, got {args.max_tokens}")
    if not (args.temperature >= 0 and np.isfinite(args.temperature)) or not 0 < args.top_p <= 1:
        raise InferError(f"--temperature must be >= 0 and --top-p in (0, 1], got {args.temperature}, {args.top_p}")
    if not 1 <= args.batch <= 1024 or not 0 <= args.seed < 2**31:
        raise InferError(f"--batch between 1 and 1024 and --seed in [0, 2**31), got {args.batch}, {args.seed}")
    return out


def _model_of(args: argparse.Namespace) -> tuple[Source | None, str, str]:
    """The adapter ``--adapter`` names (None: the bare base model; a run must have one policy),
    the base model's name (``--model``, else the adapter's) and its folder."""
    from opentinker.control.sources import CliError, base_model, read_source
    from opentinker.engine.model_specs import resolve_model

    source = None
    if args.adapter:
        try:
            source = read_source(args.adapter)
        except CliError as e:
            raise InferError(f"--adapter {e}") from None
        if len(source.adapters) != 1:
            raise InferError(f"--adapter {args.adapter}: a run of {len(source.adapters)} policies; give one of "
                             "its adapters/<policy> folders")
    model = base_model(source, args.model)
    try:
        model_path = resolve_model(model)
    except (OSError, ValueError) as e:
        raise InferError(f"model {model}: {e}") from None
    return source, model, model_path


def _start_job(args: argparse.Namespace, model: str, model_path: str, tmp: str) -> tuple[JobConfig, Job]:
    """A job of a scheduler alone (in this process, or on ``--scheduler``'s) with its run
    folder in ``tmp``; :class:`InferError` for bad ``--threads``/``--device``/``--scheduler``
    or a shared scheduler that refuses it."""
    from opentinker.config import ConfigError, config_from_dict
    from opentinker.control.config_checks import check_config
    from opentinker.control.runtime import Job

    model_table = {"base": model, **({"threads": args.threads} if args.threads else {}),
                   **({"device": args.device} if args.device else {})}
    try:
        cfg = config_from_dict({"name": "infer", "out_dir": tmp, "sampling": {"max_tokens": args.max_tokens},
                               "model": model_table, "runtime": {"backend": "local", "scheduler": args.scheduler}})
        check_config(cfg)
    except ConfigError as e:  # --threads, --device, --scheduler
        raise InferError(str(e)) from None
    try:
        job = Job(cfg, model_path, run_dir=tmp, scheduler_only=True)
    except ConfigError as e:  # a shared scheduler that refuses the job
        raise InferError(str(e)) from None
    return cfg, job


def _load_adapter(client: SyncClient, adapter: str, source: Source, tmp: Path) -> str:
    """Load the adapter of ``source`` (copied into the job's folder ``tmp``, less its
    optimizer state) on the scheduler, frozen; its name there."""
    from opentinker.bus.common import RemoteError
    from opentinker.control.sources import stage_adapters
    from protocols.messages import AdapterInfo, LoadAdapter

    ((label, path),) = stage_adapters(source.adapters, tmp, skip=("learner_state.json",
                                                                  "optimizer.safetensors")).items()
    try:
        info = client.request(LoadAdapter(path=path, name=label, trainable=False), 600)
    except RemoteError as e:  # e.g. an adapter of another base model
        raise InferError(f"--adapter {adapter}: {e.error.message}") from None
    assert isinstance(info, AdapterInfo)
    return label


@dataclass(frozen=True)
class _Batches:
    """What each batch of prompts is sampled with."""

    args: argparse.Namespace
    """``--batch``, ``--seed``, ``--max-tokens``, ``--timeout-s``."""
    tok: ChatTokenizer
    prompts: list[Prompt]
    params: SamplingParams
    """The sampling of the first line (line ``i`` draws with seed ``--seed + i``)."""
    adapter: str | None
    """The adapter's name on the scheduler (None: the bare base model)."""


def _write_replies(client: SyncClient, f: TextIO, run: _Batches, progress: Any) -> int:
    """Sample the prompts in batches of ``--batch`` and write one JSON line per prompt to ``f``
    (flushed after each batch, then ``progress(done, total)``); the tokens drawn."""
    import msgspec

    from opentinker.bus.common import RemoteError
    from opentinker.serve.detokenize import ChoiceText, finish_choices
    from protocols.messages import SampleRequest, SampleResult

    args, prompts, drawn = run.args, run.prompts, 0
    for start in range(0, len(prompts), args.batch):
        batch = prompts[start:start + args.batch]
        req = SampleRequest(adapter=run.adapter, prompts=[p.tokens for p in batch], client="infer",
                            params=msgspec.structs.replace(run.params, seed=args.seed + start))
        try:
            result = client.request(req, args.timeout_s)
        except (RemoteError, TimeoutError) as e:
            raise InferError(f"prompts {start + 1} to {start + len(batch)}: the scheduler did not "
                             f"answer them: {e}") from None
        assert isinstance(result, SampleResult)
        rows = [ChoiceText(run.tok, [], args.max_tokens) for _ in batch]
        finish_choices(rows, result)
        for p, row in zip(batch, rows):
            drawn += row.drawn
            f.write(json.dumps({"id": p.id, "text": row.text, "finish_reason": row.finish,
                                "tokens": row.ids, "logprobs": row.logprobs,
                                "prompt_tokens": len(p.tokens), "model": run.adapter or "base",
                                "adapter_version": result.adapter_version}) + "\n")
        f.flush()
        if progress is not None:
            progress(start + len(batch), len(prompts))
    return drawn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", help='JSON Lines: {"messages": [...]} or {"prompt": "..."}, optional "id"')
    parser.add_argument("--out", required=True, help="where the replies go, one JSON line per prompt (must be new)")
    parser.add_argument("--adapter", default="", metavar="PATH",
                        help="a saved adapter folder, or a run folder of one policy (default: the bare base model)")
    parser.add_argument("--model", help="base model (default: the adapter's run's, else smollm2-135m)")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens per reply (default 128)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1: off)")
    parser.add_argument("--seed", type=int, default=0, help="line i draws with seed + i (default 0)")
    parser.add_argument("--batch", type=int, default=32, help="prompts per request to the scheduler (default 32)")
    parser.add_argument("--threads", type=int, help="torch threads of the scheduler (default: every core)")
    parser.add_argument("--device", help="torch device (default cpu)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="longest wait for one batch (default 3600)")
    parser.add_argument("--scheduler", metavar="ADDRESS", default="",
                        help="run on a shared scheduler (opentinker serve): its bus endpoint or service file")


def main(args: argparse.Namespace) -> int:
    """``opentinker infer``: exit 0, or 2 with one line on stderr for bad input."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from opentinker.logs import escape_controls

    console = Console(stderr=True)
    try:
        if console.is_terminal:
            with Progress(TextColumn("inference"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                          console=console) as bar:
                task = bar.add_task("infer", total=None)
                summary = infer(args, lambda done, total: bar.update(task, completed=done, total=total))
        else:  # a log file: one plain line per batch
            summary = infer(args, lambda done, total: print(f"inference: {done}/{total} prompts", flush=True))
    except InferError as e:
        print(f"opentinker infer: {escape_controls(str(e))}", file=sys.stderr)
        return 2
    print(f"wrote {summary['out']}: {summary['rows']} replies, {summary['tokens_drawn']} tokens in "
          f"{summary['wall_s']:.1f} s ({summary['tokens_per_s']:.1f} tokens/s)")
    return 0
