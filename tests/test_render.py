import numpy as np
import pytest

from opentinker.rollout.render import SeatRenderer


def test_turn_deltas_rebuild_the_templated_conversation(tiny_path, chat_tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_path)
    r = SeatRenderer(chat_tok, "You are a poker player.")
    o1 = r.observe("You have the K. Reply with one word: check or bet.")
    reply1 = chat_tok.encode("check") + [chat_tok.eos_id]
    r.add_reply(reply1, stopped=True)
    o2 = r.observe("Opponent bet. Reply with one word: call or fold.")
    msgs = [
        {"role": "system", "content": "You are a poker player."},
        {"role": "user", "content": "You have the K. Reply with one word: check or bet."},
        {"role": "assistant", "content": "check"},
        {"role": "user", "content": "Opponent bet. Reply with one word: call or fold."},
    ]
    expected = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert r.tokens == expected
    assert list(o1) + reply1 + list(o2) == expected
    # The newline the template puts after the stop token opens the next observation (mask 0).
    assert o2[:2].tolist() == chat_tok.encode("\n<|im_start|>")
    assert r.prompt().dtype == np.int32


def test_reply_cut_by_length_gets_the_end_of_turn_as_observation(chat_tok):
    r = SeatRenderer(chat_tok, "S")
    r.observe("a")
    r.add_reply(chat_tok.encode("bet bet bet"), stopped=False)
    o2 = r.observe("b")
    assert o2[0] == chat_tok.eos_id  # the template's end of turn, not sampled: mask 0


def test_system_prompt_must_be_explicit(chat_tok):
    with pytest.raises(ValueError, match="system prompt"):
        SeatRenderer(chat_tok, "")
