"""Trimming a stream of what every consumer group on it has acknowledged.

An entry may go once no group can still need it: for each group, the entries below its oldest
pending entry (or, with none pending, up to its last-delivered id) are acknowledged; the stream
is trimmed (XTRIM MINID) below the smallest such bound across its groups. Recorders are consumer
groups too, so trimming waits for them. A stream with no group is left alone (nothing has read it
yet: a fresh replay, or a run whose consumers have not started).

The bound is computed and applied in one Lua script, so a group created or an entry delivered in
between cannot be trimmed from under its reader.
"""

from __future__ import annotations

import redis

_TRIM = """
local function parse(id)
  local dash = string.find(id, '-', 1, true)
  return tonumber(string.sub(id, 1, dash - 1)), tonumber(string.sub(id, dash + 1))
end
local function less(ams, aseq, bms, bseq)
  return ams < bms or (ams == bms and aseq < bseq)
end
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return -1 end
local min_ms, min_seq = nil, nil
for _, g in ipairs(groups) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  local ms, seq
  if tonumber(info['pending']) > 0 then
    local summary = redis.call('XPENDING', KEYS[1], info['name'])
    ms, seq = parse(summary[2])  -- the group's oldest unacknowledged entry stays
  else
    ms, seq = parse(info['last-delivered-id'])
    seq = seq + 1  -- everything up to the last delivered entry is acknowledged
  end
  if min_ms == nil or less(ms, seq, min_ms, min_seq) then min_ms, min_seq = ms, seq end
end
return redis.call('XTRIM', KEYS[1], 'MINID', string.format('%d-%d', min_ms, min_seq))
"""


def trim_acknowledged(r: redis.Redis, stream: str) -> int:
    """Delete the entries of `stream` that every consumer group has acknowledged; return how many
    (-1: the stream or its groups do not exist yet, nothing done)."""
    return int(r.eval(_TRIM, 1, stream))
