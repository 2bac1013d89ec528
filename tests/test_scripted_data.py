"""SFT data from a scripted seat's play (``offline.scripted``): the seat's turns rendered as the
policy's sampling renders them, its replies the only loss tokens, through the same trajectory
and datum assembly as recorded trajectories; clear config errors; an offline job on it saves
an adapter a warm start takes (local backend, tiny-random)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from conftest import DEVICE, run

import games
from games.calculator import SYSTEM_PROMPT
from games.tools import format_call
from learners import sft_datums
from opentinker.config import ConfigError, JobConfig, config_from_dict
from opentinker.rollout.episodes import play_episode
from opentinker.training.offline import training_units
from opentinker.training.scripted_data import scripted_episodes, scripted_trajectories
from protocols.messages import (
    PolicyKind,
    PolicyRef,
    RunEpisodes,
    SampleResult,
    SamplingParams,
    StopReason,
)


def _raw(tmp_path, **offline) -> dict:
    return {
        "name": "sft_calc", "game": "calculator_v0", "out_dir": str(tmp_path), "seed": 3,
        "system_prompt": SYSTEM_PROMPT,
        "model": {"base": "tiny-random", "threads": 1, "device": DEVICE},
        "runtime": {"backend": "local", "timeout_s": 120},
        "policies": [{"name": "main", "opponents": {"random": 1}}],
        "train": {"lr": 1e-2},
        "sampling": {"max_tokens": 40},
        "offline": {"kind": "sft", "scripted": "calc_tool_user", "episodes": 4, "steps": 3, "batch_size": 4,
                    **offline},
    }


def _job(tmp_path, **offline) -> JobConfig:
    return msgspec.convert(_raw(tmp_path, **offline), JobConfig)


def test_the_loss_is_on_the_scripted_replies_tokens_and_never_on_a_tool_result(tmp_path, chat_tok) -> None:
    cfg = _job(tmp_path)
    specs = scripted_episodes(cfg)
    assert len(specs) == 4 and len({s.seed for s in specs}) == 4
    assert all(s.seats == {"solver": PolicyRef(kind=PolicyKind.SCRIPTED, name="calc_tool_user")} for s in specs)
    trajectories = scripted_trajectories(cfg, chat_tok)
    units, n = training_units(cfg)
    assert n == 4 and len(units) == 4 and all(len(u) == 1 for u in units)
    eos = chat_tok.eos_id
    by_episode = {t.episode_id: t for t in trajectories}
    for spec, traj, (datum,) in zip(specs, trajectories, units, strict=True):  # what the job trains on
        probe = games.make("calculator_v0")
        probe.reset(seed=spec.seed)
        expression, value = probe.unwrapped.expression, str(probe.unwrapped.value)
        assert traj.total_reward == 1.0 and [t.reward for t in traj.turns] == [0.0, 1.0]
        call, answer = chat_tok.encode(format_call("calc", {"expression": expression})), chat_tok.encode(value)
        mask = datum.loss_inputs["mask"]
        # Under the mask: exactly the call and the answer, each with its stop token.
        assert datum.tokens[mask == 1].tolist() == [*call, eos, *answer, eos]
        o0 = len(traj.turns[0].obs_tokens)
        assert mask.tolist() == ([0.0] * o0 + [1.0] * (len(call) + 1) + [0.0] * len(traj.turns[1].obs_tokens)
                                 + [1.0] * (len(answer) + 1))
        # The tool's result (the same number) comes back as a tool message: all mask 0.
        result_turn = chat_tok.decode(traj.turns[1].obs_tokens, skip_special_tokens=False)
        assert result_turn == f"\n<|im_start|>tool\n{value}<|im_end|>\n<|im_start|>assistant\n"
        assert not mask[o0 + len(call) + 1:o0 + len(call) + 1 + len(traj.turns[1].obs_tokens)].any()
        assert by_episode[spec.episode_id] is traj
    # The same tokens as an LLM seat that wrote these replies: one renderer for both.
    spec = specs[0]
    llm = msgspec.structs.replace(spec, seats={"solver": PolicyRef(kind=PolicyKind.ADAPTER, name="main")})
    replies = iter(chat_tok.decode(t.sampled_tokens) for t in trajectories[0].turns)

    async def sample(ref, prompt, params):
        toks = np.asarray([*chat_tok.encode(next(replies)), eos], np.int32)
        return SampleResult(tokens=[toks], logprobs=[np.zeros(len(toks), np.float32)],
                            stop_reasons=[StopReason.STOP], adapter_version=0, batch_id=0)

    msg = RunEpisodes(episodes=[llm], sampling=SamplingParams(max_tokens=40), system_prompt=SYSTEM_PROMPT,
                      learners={"main": ""})
    _, (policy_traj,) = run(play_episode(llm, msg, chat_tok, sample))
    (want,), (got,) = sft_datums([policy_traj], 0.0), sft_datums(trajectories[:1], 0.0)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.loss_inputs["mask"].tolist() == want.loss_inputs["mask"].tolist()


@pytest.mark.parametrize(("change", "match"), [
    ({"offline": {"scripted": "no_such_seat"}}, (r"offline.scripted: 'no_such_seat' is not a scripted policy; "
                                                 r"calculator_v0's are random, calc_tool_user, calc_no_tool")),
    ({"offline": {"scripted": "kuhn_equilibrium"}}, (r"offline.scripted: 'kuhn_equilibrium' is not a scripted seat "
                                                     r"of calculator_v0")),
    ({"offline": {"kind": "dpo"}}, r"offline.scripted: a scripted seat's play is SFT data"),
    ({"offline": {"data": "runs/x/trajectories"}}, r"offline.data: give either data .* or scripted .*, not both"),
    ({"offline": {"scripted": ""}}, r"offline.data: give either .*, not neither"),
    ({"game": "kuhn_poker_v0", "offline": {"scripted": "kuhn_equilibrium"},
      "policies": [{"name": "main", "opponents": {"base": 1}}]},
     r"offline.scripted: policies\[main\].opponents \['base'\] would need a model to play"),
])
def test_a_scripted_seat_that_cannot_give_data_is_a_config_error(tmp_path, change, match) -> None:
    raw = _raw(tmp_path)
    raw.update({k: v for k, v in change.items() if k != "offline"})
    raw["offline"].update(change.get("offline", {}))
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw)


def test_the_bundled_sft_job_saves_an_adapter_the_warm_job_takes(tmp_path, tiny_path) -> None:
    """``opentinker run tools_sft`` (cut down, on tiny-random) learns its data and saves an
    adapter that ``tools_warm`` takes as ``policies[0].init`` (checked before anything starts)."""
    import json

    from opentinker.cli import main
    from opentinker.config import load_config
    from opentinker.control.config_checks import check_config

    small = ["model.base=tiny-random", "model.threads=1", "runtime.backend=local", f"out_dir={tmp_path}",
             "offline.episodes=4", "offline.steps=3", "offline.batch_size=4", "train.lr=1e-2"]
    assert main(["run", "tools_sft", *(x for s in small for x in ("--set", s))]) == 0
    (run_dir,) = tmp_path.glob("calculator_v0__tools_sft__0__*")
    summary = json.loads((run_dir / "summary.json").read_text())
    key = "eval/main/sft/loss"
    assert summary["data"] == "calc_tool_user's play (4 episodes)" and summary["units"] == 4
    assert summary["last_eval"][key] < summary["first_eval"][key]
    adapter = run_dir / "adapters" / "main"
    assert summary["adapters"]["main"] == str(adapter)
    warm = load_config("tools_warm", {"model": {"base": "tiny-random"}, "out_dir": str(tmp_path),
                                      "policies": [{"name": "main", "opponents": {"random": 1}, "init": str(adapter)}]})
    check_config(warm)
