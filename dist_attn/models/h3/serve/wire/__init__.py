# SPDX-License-Identifier: Apache-2.0
"""What the ranks say to each other outside attention: rank 0's control messages, the abort vote
every rank joins between denoise steps, and the prompt encoding rank 0 broadcasts."""

from dist_attn.models.h3.serve.wire.abort import Abort, agree_abort
from dist_attn.models.h3.serve.wire.control import WIRE_FIELDS, Control, Op, comm_device, exchange
from dist_attn.models.h3.serve.wire.prompt import broadcast_prompt, broadcast_text

__all__ = ["Abort", "Control", "Op", "WIRE_FIELDS", "agree_abort", "broadcast_prompt", "broadcast_text",
           "comm_device", "exchange"]
