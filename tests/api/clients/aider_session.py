"""aider, through its Python API, driving a node over several turns on one file, as a user at its prompt would.

aider sends chat completions through litellm (`openai/MODEL` at OPENAI_API_BASE), no session header: the node
keys the conversation by its opening. Run in aider's own venv (.venv-clients/aider) by
tests/api/test_real_clients.py; prints one JSON object: each completion's usage as aider received it and the
errors aider showed.

usage: aider_session.py BASE_URL MODEL WORKDIR TURNS
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would fetch its price list otherwise

from aider.coders import Coder  # noqa: E402
from aider.io import InputOutput  # noqa: E402
from aider.models import Model  # noqa: E402


class RecordingIO(InputOutput):
    """aider's console IO, with the errors it shows kept (a failed completion is shown, not raised)."""

    errors: list[str] = []

    def tool_error(self, message: str = "", strip: bool = True) -> None:
        self.errors.append(str(message))
        super().tool_error(message, strip)


def main(base_url: str, model: str, workdir: Path, turns: int) -> dict[str, Any]:
    os.environ["OPENAI_API_BASE"] = base_url
    os.environ["OPENAI_API_KEY"] = "kvmesh-test"
    usages: list[dict[str, Any]] = []
    inner = Model.send_completion

    def send_completion(self: Model, messages: Any, functions: Any, stream: bool, temperature: Any = None) -> Any:
        h, res = inner(self, messages, functions, stream, temperature)
        u = res.usage
        details = getattr(u, "prompt_tokens_details", None)
        usages.append({"prompt_tokens": u.prompt_tokens,
                       "cached_tokens": getattr(details, "cached_tokens", None) if details is not None else None})
        return h, res

    Model.send_completion = send_completion  # type: ignore[method-assign]
    src = workdir / "todo.py"
    src.write_text('"""A to-do list."""\n\nITEMS: list[str] = []\n\n\ndef add(item: str) -> None:\n    ITEMS.append(item)\n')
    io = RecordingIO(yes=True, pretty=False, fancy_input=False, root=str(workdir),
                     chat_history_file=str(workdir / ".aider.chat.history.md"))
    coder = Coder.create(main_model=Model(f"openai/{model}"), io=io, fnames=[str(src)], stream=False,
                         auto_commits=False, use_git=False, map_tokens=0, suggest_shell_commands=False,
                         detect_urls=False, auto_lint=False)
    asks = ["Explain what add() does.", "Should ITEMS be a list or a deque?", "Name one test worth writing."]
    for i in range(turns):
        coder.run(with_message=asks[i % len(asks)])
    return {"usages": usages, "errors": RecordingIO.errors}


if __name__ == "__main__":
    base, model, work, n = sys.argv[1:5]
    print(json.dumps(main(base, model, Path(work), int(n))))
