"""Multi-turn tool use on the rollout engines (`rollout.max_tool_calls` > 0, ReTool). A mixin of
`RolloutWorker`; state: ``tools`` (the `ToolRunner`) and the turns recorded in ``_pending``.

A turn that stops at `</code>` hands its program to the `ToolRunner` (sandbox calls on a thread
pool, while the engines step the other requests); when the call returns, its interpreter text is
tokenized and appended to the response as context (action_mask False, no behaviour log-prob:
placeholder 0.0 and the engine version), and a continuation request (prompt + response so far,
the rest of the `max_tokens` budget) goes back to the same engine, salted with the weights
version then loaded. Weight updates can land within a turn (in-flight requests continue) and
between turns; the per-token versions record both. After `max_tool_calls` calls the stop string
is no longer set. c(τ) is set when the last turn finishes.
"""
from __future__ import annotations

from pace.rollout import engine as engine_lib
from pace.rollout import routes as routes_lib


class ToolTurnsMixin:
    def _collect_tools(self) -> bool:
        """Append each finished call's interpreter text to its response and continue generating."""
        done = self.tools.poll()
        budget = self.cfg.rollout.max_tokens
        for (gid, idx), result, ids in done:
            pending = self._pending.get(gid)
            if pending is None:  # abandoned while its call ran (a stop)
                continue
            pending.tool_wait.discard(idx)
            traj = pending.responses[idx]
            traj.tool_calls += 1
            traj.tool_errors += not result.ok
            traj.extend(ids, 0.0, self.engine_version, action=False)  # context: no ℓ^μ, masked out of the loss
            left = budget - len(traj)
            if left <= 0:  # the tool output used up the response budget
                traj.finish_reason = "length"
                self._finish_response(pending, traj)
                continue
            pending.code_from[idx] = len(traj)  # the model writes on after the interpreter's output
            self._continue(pending, idx)
        return bool(done)

    def _continue(self, pending, idx: int) -> None:
        """Generate the rest of response ``idx`` as a new request: prompt + the response so far
        (prefilled, not sampled), the rest of the `max_tokens` budget, salted with the weights now
        loaded. After a tool call, for a response kept across a restart (pace/rollout/resuming.py)
        and for one whose engine failed (pace/rollout/failover.py). With MoE routing replay it asks
        for the routed experts of the positions not yet recorded only (pace/rollout/routes.py)."""
        traj = pending.responses[idx]
        pending.turns[idx] = pending.turns.get(idx, 0) + 1
        pending.turn_start[idx] = len(traj)  # vLLM's spans of this request start here
        traj.begin_request()  # prefilled anew: its tokens' context is this request's (KV staleness)
        prompt = {"prompt_token_ids": pending.group.prompt_ids + traj.response_ids.tolist(),
                  "cache_salt": engine_lib.cache_salt(self.engine_version)}
        pending.route_start[idx] = routes_lib.prompt_start(traj, len(pending.group.prompt_ids))
        params = self._turn_params(self.cfg.rollout.max_tokens - len(traj), calls=traj.tool_calls,
                                   routes_from=pending.route_start[idx])
        self.fleet.add_request(pending.request_id(idx), prompt, params, group=pending.key)
