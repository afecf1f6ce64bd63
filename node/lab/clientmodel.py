"""The client a load is judged by: how an agent behind the OpenAI or Anthropic SDK retries an overloaded turn.

Both SDKs (one generated template) retry a 429 or 529 `max_retries` times (2 by default): after the
server's Retry-After when it says 0-60 s, else after an exponential backoff of 0.5 s x 2^n (n the
retries made so far) capped at 8 s and shortened by up to a quarter at random; each attempt may take
`timeout` (600 s) before the client gives up. Claude Code retries about ten times (`--client
claude-code`). A turn whose retries run out, or whose attempt outlasts the timeout, has failed in the
user's face: the agent says so, and the conversation goes on with its next turn (the user asks again,
or the agent carries on; its next prompt still holds everything before, so it recomputes what the
failed turn would have cached). The SDKs retry a timed-out attempt too; here it fails the turn, as a
turn that queued ten minutes has lost its user whatever happens next.

`kvmesh sim` (and its sweep), `kvmesh load` and `bench policies` all take it from the same flags; the last
two can also send every turn through the official SDK itself (`--sdk anthropic`, node.lab.sdkclient), whose
own retry loop then runs with these retries and this timeout.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

# Retries per preset: the SDKs' default max_retries, and Claude Code's own budget.
PRESETS = {"sdk": 2, "claude-code": 10}
# The official SDKs a real load can send its turns through (`--sdk`).
SDKS = ("anthropic",)


@dataclass(frozen=True)
class ClientModel:
    retries: int = PRESETS["sdk"]
    timeout_s: float = 600.0  # one attempt's limit: the SDKs' default timeout
    max_retry_after_s: float = 60.0  # a longer Retry-After is ignored for the backoff
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def retry_delay(self, retries_made: int, retry_after_s: float | None, rng: random.Random) -> float | None:
        """Seconds until the next attempt after a refusal, with `retries_made` retries already made; None: the
        client gives up (the turn failed)."""
        if retries_made >= self.retries:
            return None
        if retry_after_s is not None and 0 < retry_after_s <= self.max_retry_after_s:
            return retry_after_s
        return min(self.backoff_s * 2.0 ** retries_made, self.max_backoff_s) * (1 - 0.25 * rng.random())


def add_client_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--client, --client-retries and --client-timeout-s (read back with `client_from_args`)."""
    parser.add_argument("--client", choices=tuple(PRESETS), default="sdk",
                        help="the retry budget of the clients: sdk (the OpenAI and Anthropic SDKs' 2 retries) or "
                        "claude-code (10); --client-retries overrides it")
    parser.add_argument("--client-retries", type=int, default=None,
                        help="retries of a refused turn before the client gives up and the turn fails (default: --client's)")
    parser.add_argument("--client-timeout-s", type=float, default=ClientModel.timeout_s,
                        help="an attempt whose first token takes longer fails its turn (the SDKs' default, 600 s)")


def add_sdk_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--sdk: send the turns through an official SDK, which retries them itself."""
    parser.add_argument("--sdk", choices=SDKS, default=None,
                        help="send every turn through this official SDK (Messages, streamed), retried by the SDK "
                        "itself with --client's retries and --client-timeout-s (default: kvmesh's own client, "
                        "which retries as the SDKs do)")


def client_from_args(args: argparse.Namespace) -> ClientModel:
    retries = args.client_retries if getattr(args, "client_retries", None) is not None else PRESETS[getattr(args, "client", "sdk")]
    return ClientModel(retries=retries, timeout_s=getattr(args, "client_timeout_s", ClientModel.timeout_s))


def check_client_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the client flags, or None."""
    if getattr(args, "client_retries", None) is not None and args.client_retries < 0:
        return f"--client-retries must be 0 or more, got {args.client_retries}"
    if getattr(args, "client_timeout_s", 1.0) <= 0:
        return f"--client-timeout-s must be above 0, got {args.client_timeout_s}"
    return None
