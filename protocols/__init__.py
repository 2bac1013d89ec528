"""The OpenTinker wire protocol: typed messages (:mod:`protocols.messages`) and their codec
(:mod:`protocols.codec`). Depends on msgspec and numpy only."""

from protocols.codec import DecodeError, decode, encode
from protocols.messages import *  # noqa: F403
from protocols.messages import PROTOCOL_VERSION, Message

__all__ = ["PROTOCOL_VERSION", "Message", "DecodeError", "decode", "encode"]
