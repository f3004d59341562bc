"""A Lua script over many jobs, one call for all: each job's commands run under ``pcall``,
so a job whose commands fail reports ``'error'`` and Redis's message, and the jobs before
and after it are handled as usual (a script's writes are not rolled back, so one failure
must not stop the rest). Used by the SDK's submits and the worker's starts."""

from __future__ import annotations

from typing import cast

# The most submits one script takes. A worker accepts a burst in pieces of this size too
# (exlq.worker.runner.ACCEPT_PIECE): 32 prompts of 256 tokens are the engine's first admission
# slice. Redis runs nothing else while a script runs, and a script's time grows with its
# jobs, so a burst goes as several scripts of a piece each rather than one long one.
PIECE_JOBS = 32


def per_job_script(setup: str, function: str, first_key: int, arg_offset: int) -> str:
    """``setup`` defines the Lua function ``function(key, arg)``, which returns
    ``{verdict, detail}``; it is called for KEYS[first_key..] with ARGV[i + arg_offset].
    The script returns verdict, detail for each of those keys in turn."""
    return f"""{setup}
local out = {{}}
for i = {first_key}, #KEYS do
  local ok, reply = pcall({function}, KEYS[i], ARGV[i + {arg_offset}])
  if not ok then
    reply = {{'error', type(reply) == 'table' and reply.err or tostring(reply)}}
  end
  out[#out + 1] = reply[1]
  out[#out + 1] = reply[2]
end
return out
"""


def reply_pairs(reply: object) -> list[tuple[str, str]]:
    """(verdict, detail) for each job, from the script's flat reply."""
    parts = [p.decode() if isinstance(p, bytes) else str(p) for p in cast("list[object]", reply)]
    return list(zip(parts[::2], parts[1::2], strict=True))
