"""The worker's Lua scripts: what it must do atomically in Redis (take entries, start jobs,
write a step's events and finals, renew its claims). broker.py sends them.

Two rules hold in every script that writes. A command that can meet a consumer group or a
stream Redis has lost (NOGROUP) runs under ``pcall``, so the script ends normally and says
which entries are gone. And every check runs before the first write: Redis does not roll a
script back, so one that failed half-way and is sent again would repeat what it had done."""

from __future__ import annotations

from exlq.protocol.batch_script import per_job_script

# Take entries: XREADGROUP (ARGV[1] = 'read') or XAUTOCLAIM from cursor ARGV[6] (ARGV[1] =
# 'claim'), up to ARGV[4] entries, for consumer ARGV[3] of group ARGV[2]; ARGV[5]: the
# longest payload that comes back whole. A longer one comes back as its first ARGV[7]
# bytes and its last ARGV[9]: the worker refuses it by its size, and never holds the rest.
# KEYS are the queue's lane streams. A claim takes from KEYS[1]. A read follows its plan
# (worker/lanes.py): from ARGV[10] on, pairs of a stream's index in KEYS and the most that
# stream may bring in this read, counting the plan's earlier steps on it. Returns the next
# cursor ('0-0' for a read), then for each entry its stream's index, its id, payload (nil
# without a 'job' field), 'more' field, the payload's full size, and the tail of a payload
# cut to its head (else nil).
TAKE_LUA = """
local total = tonumber(ARGV[4])
local limit, head = tonumber(ARGV[5]), tonumber(ARGV[7])
local out = {'0-0'}
local function keep(lane, entries)
  for _, e in ipairs(entries) do
    -- Redis 6.2's XAUTOCLAIM reports an entry deleted while pending as nil (false here).
    if e then
      local job, more, size, tail = false, '0', -1, false
      local fields = e[2] or {}
      for i = 1, #fields, 2 do
        if fields[i] == 'job' then job = fields[i + 1]
        elseif fields[i] == 'more' then more = fields[i + 1] end
      end
      if job then
        size = #job
        if size > limit then
          tail = string.sub(job, -tonumber(ARGV[9]))
          job = string.sub(job, 1, head)
        end
      end
      out[#out + 1] = lane
      out[#out + 1] = e[1]
      out[#out + 1] = job
      out[#out + 1] = more
      out[#out + 1] = size
      out[#out + 1] = tail
    end
  end
  return #entries
end
if ARGV[1] == 'claim' then
  local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[2], ARGV[3], ARGV[8], ARGV[6],
                           'COUNT', total)
  out[1] = reply[1]
  keep(1, reply[2])
  return out
end
local taken, by_lane = 0, {}
for i = 10, #ARGV, 2 do
  local lane, cap = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  local count = math.min(cap - (by_lane[lane] or 0), total - taken)
  if count > 0 then
    local reply = redis.call('XREADGROUP', 'GROUP', ARGV[2], ARGV[3], 'COUNT', count,
                             'STREAMS', KEYS[lane], '>')
    local got = reply and keep(lane, reply[1][2]) or 0
    taken = taken + got
    by_lane[lane] = (by_lane[lane] or 0) + got
  end
end
return out
"""

# An entry as a worker names it (keys.entry_ref): '<id>' in the interactive lane's stream,
# KEYS[1], and '<id>@batch' in the batch lane's, the key at index BATCH_KEY. The stream and
# the id in it.
_ENTRY_LUA = """
local function stream_of(entry)
  local at = string.find(entry, '@', 1, true)
  if at then return KEYS[BATCH_KEY], string.sub(entry, 1, at - 1) end
  return KEYS[1], entry
end
"""

# Whether consumer ARGV[2] of group ARGV[1] still owns an entry: 'mine', 'taken' (another
# worker's now) or 'gone' (pending for nobody: acked, or the stream or its group lost, say
# by a Redis restart without persistence).
_OWNER_LUA = """
local owners = {}
local function owner(entry)
  local known = owners[entry]
  if known then return known end
  local stream, id = stream_of(entry)
  local ok, pending = pcall(redis.call, 'XPENDING', stream, ARGV[1], id, id, 1)
  if not ok or pending[1] == nil then known = 'gone'
  elseif pending[1][2] == ARGV[2] then known = 'mine'
  else known = 'taken' end
  owners[entry] = known
  return known
end
"""

# One or more engine steps' writes. KEYS: jobs stream, dead stream, the queue's commit
# markers (a hash: one field per worker), the batch lane's stream, then the result and job
# keys of each final that
# names a job (its "k" is the index of its result key: every key a script touches is
# declared, as Redis Cluster and ACLs expect). ARGV: group, consumer, result TTL, dead
# stream cap, the lease (Redis time in ms until which no other worker can have taken this
# batch's entries), the batch as JSON, the batch's unique name, the markers' TTL, the
# queue's key prefix (a channel under it is a job's shard channel: SPUBLISH).
#
# Publishing never repeats. The worker's marker holds the name of the last batch this worker wrote
# and the entries it reported: a batch sent again (its reply was lost with the connection)
# is answered from it, and publishes nothing twice. The marker is the script's first write,
# so a Redis out of memory refuses the script before anything is published.
#
# Publishing never outlives ownership. Past the lease (the worker was paused, or its
# renewals failed), each publish's entry is checked, and a publish for an entry this worker
# no longer owns is dropped. Finals are always checked: a final is written only for an
# entry this worker owns, and its result, final event and ack go together.
#
# Returns entry, reason pairs for the entries whose events or final were not written:
# 'taken', 'gone', or 'error: ...' (a final whose writes Redis refused).
COMMIT_LUA = (
    _ENTRY_LUA.replace("BATCH_KEY", "4")
    + _OWNER_LUA
    + """
local seen = redis.call('HGET', KEYS[3], ARGV[2])
if seen then
  local marker = cjson.decode(seen)
  if marker.n == ARGV[7] then return marker.lost end
end
local batch = cjson.decode(ARGV[6])
-- A channel in the queue's key space (ARGV[9], its hash tag) is a job's shard channel
-- (wire version 2), in the queue's slot; any other is a job's own channel. A Redis without
-- SPUBLISH (before 7) is never sent such a job by the SDK; pcall keeps one sent by hand
-- from failing the batch.
local function send_event(channel, event)
  if string.sub(channel, 1, #ARGV[9]) == ARGV[9] then
    redis.pcall('SPUBLISH', channel, event)
  else
    redis.call('PUBLISH', channel, event)
  end
end
local now = redis.call('TIME')
local checked = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) > tonumber(ARGV[5])
local lost, reported = {}, {}
local function report(entry, why)
  if not reported[entry] then
    reported[entry] = true
    lost[#lost + 1] = entry
    lost[#lost + 1] = why
  end
end
-- Within the lease (the common case) the events go out as they came, with no check and
-- no copy; past it, only those of entries this worker still owns.
local publish = batch.publish or {}
if checked then
  local owned = {}
  for _, p in ipairs(publish) do
    local why = owner(p[3])
    if why == 'mine' then owned[#owned + 1] = p else report(p[3], why) end
  end
  publish = owned
end
local finals = {}
for _, f in ipairs(batch.finals or {}) do
  local why = owner(f.entry)
  if why == 'mine' then finals[#finals + 1] = f else report(f.entry, why) end
end
redis.call('HSET', KEYS[3], ARGV[2], cjson.encode({n = ARGV[7], lost = lost}))
redis.call('EXPIRE', KEYS[3], ARGV[8])
for _, p in ipairs(publish) do send_event(p[1], p[2]) end
local function write(f)
  local job = f.k and KEYS[f.k + 1]
  if f.guard then
    local other = redis.call('HGET', job, 'entry')
    if other and other ~= f.entry then
      -- A rejected entry naming another entry's job: leave that job's result and events be.
      f.result = nil
      f.event = nil
    end
  end
  if f.result then
    redis.call('SET', KEYS[f.k], f.result, 'EX', ARGV[3])
    redis.call('HSET', job, 'state', f.state, 'worker', ARGV[2])
    redis.call('EXPIRE', job, ARGV[3])
  end
  if f.dead then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(f.dead))
  end
  if f.event then send_event(f.channel, f.event) end
  if not f.noack then
    local stream, id = stream_of(f.entry)
    redis.call('XACK', stream, ARGV[1], id)
  end
end
for _, f in ipairs(finals) do
  local ok, err = pcall(write, f)
  if not ok then
    lost[#lost + 1] = f.entry
    lost[#lost + 1] = 'error: ' .. (type(err) == 'table' and err.err or tostring(err))
  end
end
return lost
"""
)

# Renew this worker's claim on entries it still owns (resets their idle time) and the TTL
# of their jobs' state hashes, and report the ones it does not own: never take an entry
# back from its new owner. The start script gives a job's hash the result TTL; a run longer
# than that would lose the hash mid-run, and with it the cancel flag and the count of
# attempts (a retry would count from 1 again, and subscribers would drop its events as an
# earlier attempt's). KEYS[1] is the jobs stream, KEYS[2] the batch lane's, KEYS[2 + i] job
# i's hash; ARGV: group, consumer, state TTL, then entry i at ARGV[3 + i]. Returns entry,
# reason pairs ('taken' or 'gone') for the entries not renewed.
RENEW_LUA = (
    _ENTRY_LUA.replace("BATCH_KEY", "2")
    + _OWNER_LUA
    + """
local lost = {}
for i = 4, #ARGV do
  local why = owner(ARGV[i])
  if why == 'mine' then
    local stream, id = stream_of(ARGV[i])
    redis.call('XCLAIM', stream, ARGV[1], ARGV[2], 0, id, 'JUSTID')
    redis.call('EXPIRE', KEYS[i - 1], ARGV[3])
  else
    lost[#lost + 1] = ARGV[i]
    lost[#lost + 1] = why
  end
end
return lost
"""
)

# Publish the event that says Redis lost a job, unless its state hash exists again (the
# job was submitted anew, or another worker's run wrote its end). KEYS[1]: the job's hash;
# ARGV: channel, event, the queue's key prefix (a channel under it is a shard channel).
LOST_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if string.sub(ARGV[1], 1, #ARGV[3]) == ARGV[3] then
  redis.pcall('SPUBLISH', ARGV[1], ARGV[2])
else
  redis.call('PUBLISH', ARGV[1], ARGV[2])
end
return 1
"""

# Runs when a worker takes entries: for each, skip jobs that ended or were cancelled,
# count the attempt and record who runs it, atomically so two entries of one id never both
# run. KEYS[i] is job i's state hash, ARGV[2 + i] its entry; ARGV[1] the consumer, ARGV[2]
# the state TTL.
START_MANY_LUA = per_job_script(
    """
local function start(job, entry_id)
  local state = redis.call('HGET', job, 'state')
  if state == 'done' or state == 'failed' or state == 'cancelled' or state == 'expired' then
    return {'ended', state}
  end
  local entry = redis.call('HGET', job, 'entry')
  if entry and entry ~= entry_id then return {'duplicate', entry} end
  if redis.call('HGET', job, 'cancel') == '1' then return {'cancel', '0'} end
  local attempts = redis.call('HINCRBY', job, 'attempts', 1)
  redis.call('HSET', job, 'state', 'running', 'worker', ARGV[1], 'entry', entry_id)
  redis.call('EXPIRE', job, ARGV[2])
  return {'run', tostring(attempts)}
end""",
    "start",
    first_key=1,
    arg_offset=2,
)
