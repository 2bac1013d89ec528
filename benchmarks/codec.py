"""Encoding and decoding of protocol messages (``protocols.codec``) against pickle protocol 5
with out-of-band buffers (the fastest general Python serialiser that also keeps arrays out of
the byte stream; the bus never uses pickle, this is only the yardstick), in one run.

Messages: a ``LogprobsResult`` with one 1 MiB array; a ``SampleRequest`` with 16 prompts of 40
tokens; a ``ForwardBackward`` of 64 datums with 4 arrays each (a training step's request).
The table gives the median µs of ``--repeats`` timings of ``--number`` calls each, and the
ratio to pickle's.

    python benchmarks/codec.py --json codec.json
"""

from __future__ import annotations

import json
import pickle
import statistics
import timeit
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from _args import parse_args
from _machine import script_provenance
from protocols.codec import decode, encode
from protocols.messages import (
    Datum,
    ForwardBackward,
    LogprobsResult,
    Message,
    SampleRequest,
    SamplingParams,
)


@dataclass
class Args:
    number: int = 2000
    repeats: int = 7
    json: str = ""


def parse() -> Args:
    return parse_args(Args, __doc__)[0]


def messages() -> dict[str, Message]:
    rng = np.random.default_rng(0)
    datums = [Datum(tokens=rng.integers(0, 49152, 60).astype(np.int32),
                    loss_inputs={k: rng.standard_normal(60).astype(np.float32)
                                 for k in ("mask", "advantages", "sampler_logprobs")}) for _ in range(64)]
    return {
        "1 MiB array": LogprobsResult(logprobs=[rng.standard_normal(1 << 18).astype(np.float32)], adapter_version=3),
        "16 prompts": SampleRequest(adapter="main", prompts=[rng.integers(0, 49152, 40).astype(np.int32)
                                                             for _ in range(16)], params=SamplingParams()),
        "64 datums x 4 arrays": ForwardBackward(adapter="main", datums=datums, loss="ppo", normalizer=640.0),
    }


def pickle_encode(msg: Message) -> list[Any]:
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
    return [body, *(b.raw() for b in buffers)]


def pickle_decode(frames: list[Any]) -> Any:
    return pickle.loads(frames[0], buffers=frames[1:])


def median_us(fn: Any, args: Args) -> float:
    return statistics.median(timeit.repeat(fn, number=args.number, repeat=args.repeats)) / args.number * 1e6


def main() -> None:
    args = parse()
    rows = []
    for name, msg in messages().items():
        frames, pframes = encode(msg, 1), pickle_encode(msg)
        # Both round trips give the message back: it re-encodes to the same bytes.
        same = [bytes(memoryview(f)) for f in frames]
        for back in (decode(frames)[1], pickle_decode(pframes)):
            assert [bytes(memoryview(f)) for f in encode(back, 1)] == same, name
        row = {"message": name, "arrays": len(frames) - 2,
               "encode_us": median_us(lambda m=msg: encode(m, 1), args),
               "decode_us": median_us(lambda f=frames: decode(f), args),
               "pickle_encode_us": median_us(lambda m=msg: pickle_encode(m), args),
               "pickle_decode_us": median_us(lambda f=pframes: pickle_decode(f), args)}
        row["encode_vs_pickle"] = row["encode_us"] / row["pickle_encode_us"]
        row["decode_vs_pickle"] = row["decode_us"] / row["pickle_decode_us"]
        rows.append(row)
    table = Table(title=f"protocols.codec vs pickle 5 with out-of-band buffers (median of {args.repeats} x {args.number})")
    for col in ("message", "arrays", "encode µs", "pickle µs", "encode / pickle", "decode µs", "pickle µs ",
                "decode / pickle"):
        table.add_column(col, justify="left" if col == "message" else "right")
    for r in rows:
        table.add_row(r["message"], str(r["arrays"]), f"{r['encode_us']:.1f}", f"{r['pickle_encode_us']:.1f}",
                      f"{r['encode_vs_pickle']:.2f}x", f"{r['decode_us']:.1f}", f"{r['pickle_decode_us']:.1f}",
                      f"{r['decode_vs_pickle']:.2f}x")
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": script_provenance(args, 1), "args": asdict(args), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
