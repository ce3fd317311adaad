"""mini-swe-agent (through litellm) on agentkv: one model per run carries its session id.

mini-swe-agent passes its model's ``model_kwargs`` to every ``litellm.completion`` call, so the
one line is the run's model. Its bash commands are not run here (the environment answers
every command and submits at the second, as a random-weight model writes random commands);
with a real model use ``LocalEnvironment()``. A random-weight model's commands often run past
``max_tokens`` (mini-swe-agent reports a format error and asks again), so the run ends within
3 turns as Submitted, LimitsExceeded or RepeatedFormatError. See docs/frameworks.md. Start the
server (common.SERVE), then

    python examples/frameworks/mini_swe_agent.py --base-url http://127.0.0.1:8000/v1
"""

import os
from typing import Any

from common import MAX_TOKENS, QUESTION, parse_args, show


def main() -> None:
    args = parse_args(__doc__)
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    litellm.suppress_debug_info = True  # its cost lookup's banner

    class EchoEnvironment(LocalEnvironment):
        commands = 0

        def execute(self, action: dict[str, Any], cwd: str = "", **kw: Any) -> dict[str, Any]:
            print("would run:", action.get("command"))
            self.commands += 1
            done = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n" if self.commands > 1 else ""
            output = {"output": done + "sunny\n", "returncode": 0, "exception_info": ""}
            self._check_finished(output)  # mini-swe-agent's own end of a run, at the second
            return output

    model = LitellmModel(
        model_name=f"openai/{args.model}",
        cost_tracking="ignore_errors",
        model_kwargs={
            "api_base": args.base_url,
            "api_key": args.api_key,
            "max_tokens": MAX_TOKENS,
            "tool_choice": {"type": "function", "function": {"name": "bash"}},
            # The one line: this run's session id.
            "extra_headers": {"x-session-id": args.session_id},
        },
    )
    agent = DefaultAgent(
        model,
        EchoEnvironment(),
        system_template="You are a helpful assistant that runs bash commands.",
        instance_template="{{task}}",
        step_limit=3,
    )
    print("exit:", agent.run(QUESTION).get("exit_status"))
    show(args)


if __name__ == "__main__":
    main()
