"""Training log-probs with the shared-prefix tree vs a plain padded batch (what a PEFT
training loop does), on a realistic Kuhn poker batch, in one run on one machine.

Both compute the same loss and gradients (checked here); the table gives the time of one
``forward_backward`` over the batch and the ratio.

    python benchmarks/shared_forward.py --model smollm2-135m --rows 64 --json out.json
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from _args import parse_args
from _machine import script_provenance
from games import kuhn_poker
from opentinker.engine.host import ModelHost
from opentinker.engine.model_specs import resolve_model
from opentinker.rollout.render import ChatTokenizer, SeatRenderer
from protocols.messages import Datum, LoraSpec, SamplingParams


@dataclass
class Args:
    model: str = "smollm2-135m"
    rows: int = 64
    repeats: int = 3
    threads: int = 2
    device: str = "cpu"
    seed: int = 0
    json: str = ""


def parse() -> Args:
    return parse_args(Args, __doc__)[0]


def kuhn_batch(host: ModelHost, tok: ChatTokenizer, rows: int, seed: int) -> list[Datum]:
    """``rows`` datums: first decisions at random information states, replies sampled from the
    model itself (so the batch has the reply diversity of early training)."""
    rng = np.random.default_rng(seed)
    dialogues = kuhn_poker.decision_dialogues()
    prompts, renderers = [], []
    for _ in range(rows):
        d = dialogues[int(rng.integers(len(dialogues)))]
        r = SeatRenderer(tok, "You are a poker player.")
        for obs, reply in zip(d.observations[:-1], d.replies):
            r.observe(obs)
            r.add_reply(tok.encode(reply) + [tok.eos_id], True)
        r.observe(d.observations[-1])
        prompts.append(r.prompt())
        renderers.append(r)
    params = SamplingParams(max_tokens=6, stop_token_ids=(tok.eos_id,))
    sampled = host.sample(["bench"] * rows, prompts, [params] * rows, list(range(seed, seed + rows)))
    datums = []
    for prompt, s in zip(prompts, sampled):
        tokens = np.concatenate([prompt, s.tokens]).astype(np.int32)
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(s.tokens))].astype(np.float32)
        lp = np.r_[np.zeros(len(prompt)), s.logprobs].astype(np.float32)
        datums.append(Datum(tokens=tokens, loss_inputs={"mask": mask, "advantages": mask * rng.normal(), "sampler_logprobs": lp}))
    return datums


def timed(host: ModelHost, datums: list[Datum], share: bool, repeats: int) -> tuple[list[float], float, torch.Tensor]:
    host.share_prefix = share
    times, loss, grad = [], 0.0, None
    normalizer = float(sum(d.loss_inputs["mask"].sum() for d in datums))
    for _ in range(repeats):
        t = time.perf_counter()
        loss, _ = host.forward_backward("bench", datums, "ppo", {}, normalizer)
        times.append(time.perf_counter() - t)
        grad = torch.cat([p.grad.flatten() for p in host.adapters["bench"].params]).cpu().clone()
        for p in host.adapters["bench"].params:
            p.grad = None
    return times, loss, grad


def main() -> None:
    args = parse()
    path = resolve_model(args.model)
    host = ModelHost(path, threads=args.threads, device=args.device)
    host.create_adapter("bench", LoraSpec(rank=8))
    tok = ChatTokenizer(path)
    datums = kuhn_batch(host, tok, args.rows, args.seed)
    tokens = sum(len(d.tokens) for d in datums)
    plain_t, plain_loss, plain_g = timed(host, datums, share=False, repeats=args.repeats)
    tree_t, tree_loss, tree_g = timed(host, datums, share=True, repeats=args.repeats)
    max_grad_diff = float((plain_g - tree_g).abs().max())
    rel = max_grad_diff / float(plain_g.abs().max())
    assert abs(plain_loss - tree_loss) < 1e-4 and rel < 1e-3, (plain_loss, tree_loss, rel)

    results = {
        "model": args.model, "device": args.device, "rows": args.rows, "tokens": tokens, "threads": args.threads,
        "plain_s": statistics.median(plain_t), "shared_s": statistics.median(tree_t),
        "speedup": statistics.median(plain_t) / statistics.median(tree_t),
        "loss_plain": plain_loss, "loss_shared": tree_loss, "max_grad_rel_diff": rel,
    }
    table = Table(title=f"forward_backward on {args.rows} Kuhn turns ({tokens} tokens), {args.model}")
    for col in ("method", "median s", "ratio"):
        table.add_column(col, justify="right")
    table.add_row("plain padded batch (baseline)", f"{results['plain_s']:.3f}", "1.00")
    table.add_row("shared prefix / context / dedup", f"{results['shared_s']:.3f}", f"{results['speedup']:.2f}x faster")
    Console().print(table)
    print(f"same loss ({plain_loss:.6f} vs {tree_loss:.6f}); max relative gradient difference {rel:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": script_provenance(args, args.threads, args.device), **results}, f, indent=1)


if __name__ == "__main__":
    main()
