"""The Lua scripts RedisStore runs with EVALSHA: each one is atomic and costs one round trip.

A script's keys always share one hash slot (RedisStore's key layout), so each runs on a Redis Cluster too.

RATE_LIMIT and CHARGE mirror `bucket.take` and `bucket.charge` line for line (same algorithm as
MemoryStore); they read the clock with TIME on the Redis server, so replicas need not agree on time.
"""
from __future__ import annotations

# Shared preamble: refill both buckets of hash KEYS[1] to `now` with limits rc, kc (0: off) and
# window w. Sets r, k (levels) and now.
_REFILL = """
local function refill(level, cap, w, elapsed)
  if cap <= 0 then return 0 end
  return math.min(cap, level + elapsed * cap / w)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function expire(key, r, k, rc, kc, w)
  local until_full = 0
  if rc > 0 then until_full = math.max(until_full, (rc - r) * w / rc) end
  if kc > 0 then until_full = math.max(until_full, (kc - k) * w / kc) end
  redis.call('HSET', key, 'r', string.format('%.17g', r), 'k', string.format('%.17g', k),
             'at', string.format('%.6f', now), 'rc', rc, 'kc', kc, 'w', string.format('%.17g', w))
  redis.call('PEXPIRE', key, math.ceil((until_full + w) * 1000))
end
"""

# KEYS[1]: the key's bucket hash. ARGV: max requests (0: off), max tokens (0: off), window_s, cost_tokens.
# Returns {allowed 0|1, retry_after_s, requests level, tokens level} (floats as strings).
RATE_LIMIT = _REFILL + """
local rc, kc, w, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local s = redis.call('HMGET', KEYS[1], 'r', 'k', 'at')
local r, k = rc, kc
if s[3] then
  local elapsed = math.max(0, now - tonumber(s[3]))
  r = refill(tonumber(s[1]), rc, w, elapsed)
  k = refill(tonumber(s[2]), kc, w, elapsed)
end
local function wait(level, need, cap)
  if cap <= 0 or level >= need - 1e-9 then return 0 end
  return (need - level) * w / cap
end
local wait_r = wait(r, 1, rc)
local wait_k = wait(k, math.min(cost, kc), kc)
local allowed = 0
if wait_r == 0 and wait_k == 0 then
  allowed = 1
  if rc > 0 then r = r - 1 end
  if kc > 0 then k = k - cost end
end
expire(KEYS[1], r, k, rc, kc, w)
return {allowed, string.format('%.17g', math.max(wait_r, wait_k)), string.format('%.17g', r),
        string.format('%.17g', k)}
"""

# KEYS[1]: the key's bucket hash. ARGV[1]: tokens to take (negative refunds). Returns 1 if settled,
# 0 if the bucket is gone (full for a whole window already) or has no token limit.
CHARGE = _REFILL + """
local s = redis.call('HMGET', KEYS[1], 'r', 'k', 'at', 'rc', 'kc', 'w')
if not s[3] then return 0 end
local rc, kc, w = tonumber(s[4]), tonumber(s[5]), tonumber(s[6])
if kc <= 0 then return 0 end
local elapsed = math.max(0, now - tonumber(s[3]))
local r = refill(tonumber(s[1]), rc, w, elapsed)
local k = math.min(kc, refill(tonumber(s[2]), kc, w, elapsed) - tonumber(ARGV[1]))
expire(KEYS[1], r, k, rc, kc, w)
return 1
"""

# KEYS[1]: the key's usage hash. ARGV: requests, prompt, cached, completion (added to the fields of the same
# names).
RECORD_USAGE = """
redis.call('HINCRBY', KEYS[1], 'requests', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'prompt', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'cached', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'completion', ARGV[4])
"""

# Sessions: KEYS[1] the session hash {e: endpoint, ttl: ms}; KEYS[2] the index of live sessions, a
# sorted set of session keys scored by expiry (ms on Redis's clock), so they can be counted; expired
# members are pruned on every write, so it holds only what lives. The index is one of several shards,
# the one whose hash tag the session's key carries.
_NOW_MS = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Returns the endpoint and pushes its expiry out again.
GET_SESSION = _NOW_MS + """
local v = redis.call('HMGET', KEYS[1], 'e', 'ttl')
if v[1] then
  redis.call('PEXPIRE', KEYS[1], v[2])
  redis.call('ZADD', KEYS[2], now_ms + tonumber(v[2]), KEYS[1])
end
return v[1]
"""

# ARGV: endpoint, ttl_ms.
SET_SESSION = _NOW_MS + """
redis.call('HSET', KEYS[1], 'e', ARGV[1], 'ttl', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[2]), KEYS[1])
"""

# KEYS[1]: one shard of the index alone. Returns its live sessions.
COUNT_SESSIONS = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
return redis.call('ZCARD', KEYS[1])
"""

# KEYS[1]: the in-flight hash, one field per replica: "<expiry ms>|<its counts per endpoint, JSON>". ARGV[1]:
# this replica, ARGV[2]: TTL in ms, ARGV[3]: its counts. Stores ours, deletes expired replicas (a dead
# replica's leases vanish after its TTL) and returns the other live replicas' counts summed per endpoint, as
# JSON: one round trip, and a reply the size of one replica's counts however many replicas there are. What
# is not a JSON object of endpoint to numbers (another version's entry, say) adds nothing.
SHARE_INFLIGHT = _NOW_MS + """
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d', now_ms + ttl) .. '|' .. ARGV[3])
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
local all = redis.call('HGETALL', KEYS[1])
local sums = {}
for i = 1, #all, 2 do
  local v = all[i + 1]
  local sep = string.find(v, '|', 1, true)
  local expires = sep and tonumber(string.sub(v, 1, sep - 1))
  if not expires or expires <= now_ms then
    redis.call('HDEL', KEYS[1], all[i])
  elseif all[i] ~= ARGV[1] then
    local ok, counts = pcall(cjson.decode, string.sub(v, sep + 1))
    if ok and type(counts) == 'table' then
      for endpoint, values in pairs(counts) do
        if type(endpoint) == 'string' and type(values) == 'table' then
          local total = sums[endpoint] or {}
          sums[endpoint] = total
          for j, value in ipairs(values) do
            total[j] = (total[j] or 0) + (type(value) == 'number' and value or 0)
          end
        end
      end
    end
  end
end
return cjson.encode(sums)
"""
