//! Playing a Redisson client in a fair lock's queue: the queue's keys, and Redisson's
//! acquisition and give-up steps written from the facts in redisson-layout.md (no Redisson
//! code), for tests of a queue that distlock and Redisson waiters share.

pub fn queue(name: &str) -> String {
    format!("redisson_lock_queue:{{{name}}}")
}

pub fn timeouts(name: &str) -> String {
    format!("redisson_lock_timeout:{{{name}}}")
}

pub fn waiters(name: &str) -> String {
    format!("distlock_fair_waiters:{{{name}}}")
}

pub async fn server_time_ms(conn: &mut redis::aio::MultiplexedConnection) -> i64 {
    let (seconds, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await.expect("TIME");
    seconds * 1000 + micros / 1000
}

/// Redisson's fair-lock acquisition, written from the facts in redisson-layout.md, for
/// playing a Redisson client in a mixed queue: drop gone heads, take the lock when free
/// and first (one wait off every score), or queue scored one wait behind the last waiter.
/// KEYS: lock, queue, timeouts. ARGV: lease, owner, wait, now (ms). Answers nil when it
/// holds the lock, else how long it expects to wait.
pub const REDISSON_FAIR_ACQUIRE: &str = r"
while true do
    local head = redis.call('lindex', KEYS[2], 0)
    if not head then break end
    local score = tonumber(redis.call('zscore', KEYS[3], head))
    if score == nil or score > tonumber(ARGV[4]) then break end
    redis.call('zrem', KEYS[3], head)
    redis.call('lpop', KEYS[2])
end
if redis.call('exists', KEYS[1]) == 0 and (redis.call('exists', KEYS[2]) == 0
        or redis.call('lindex', KEYS[2], 0) == ARGV[2]) then
    redis.call('lpop', KEYS[2])
    redis.call('zrem', KEYS[3], ARGV[2])
    for _, owner in ipairs(redis.call('zrange', KEYS[3], 0, -1)) do
        redis.call('zincrby', KEYS[3], -tonumber(ARGV[3]), owner)
    end
    redis.call('hset', KEYS[1], ARGV[2], 1)
    redis.call('pexpire', KEYS[1], ARGV[1])
    return nil
end
local mine = redis.call('zscore', KEYS[3], ARGV[2])
if mine then
    return tonumber(mine) - tonumber(ARGV[3]) - tonumber(ARGV[4])
end
local last = redis.call('lindex', KEYS[2], -1)
local ttl
if last and last ~= ARGV[2] then
    ttl = tonumber(redis.call('zscore', KEYS[3], last)) - tonumber(ARGV[4])
else
    ttl = redis.call('pttl', KEYS[1])
end
redis.call('zadd', KEYS[3], ttl + tonumber(ARGV[3]) + tonumber(ARGV[4]), ARGV[2])
redis.call('rpush', KEYS[2], ARGV[2])
return ttl
";

/// Runs [`REDISSON_FAIR_ACQUIRE`] for `owner`: true when it holds the lock.
pub async fn redisson_acquire(
    conn: &mut redis::aio::MultiplexedConnection,
    name: &str,
    owner: &str,
) -> bool {
    let now = server_time_ms(conn).await;
    let reply: Option<i64> = redis::Script::new(REDISSON_FAIR_ACQUIRE)
        .key(name)
        .key(queue(name))
        .key(timeouts(name))
        .arg(30_000)
        .arg(owner)
        .arg(300_000)
        .arg(now)
        .invoke_async(conn)
        .await
        .unwrap();
    reply.is_none()
}

/// How long, in ms from now, `owner` counts as queued by its score (Redisson's rule).
pub async fn score_left_ms(
    conn: &mut redis::aio::MultiplexedConnection,
    name: &str,
    owner: &str,
) -> i64 {
    let score: f64 = redis::cmd("ZSCORE")
        .arg(timeouts(name))
        .arg(owner)
        .query_async(conn)
        .await
        .expect("the owner is scored");
    score as i64 - server_time_ms(conn).await
}

/// Asserts that the queue's keys last at least as long as `owner`'s score: Redisson's
/// scripts keep a waiter until its score passes and never set an expiry themselves, so an
/// expiry set earlier by distlock must not take a Redisson waiter's entry with it.
pub async fn assert_entry_outlasted(
    conn: &mut redis::aio::MultiplexedConnection,
    name: &str,
    owner: &str,
) {
    let left = score_left_ms(conn, name, owner).await;
    for key in [queue(name), timeouts(name)] {
        let pttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(conn)
            .await
            .unwrap();
        assert!(
            pttl == -1 || pttl >= left,
            "{key} expires in {pttl} ms, before {owner}'s score ({left} ms from now)"
        );
    }
}

/// Redisson's "acquire failed" step, run by a Redisson waiter whose `tryLock` timed out or
/// was cancelled (redisson-layout.md, "Fair lock, giving up"): it leaves the queue, and the
/// waiters behind it move up one wait. KEYS: queue, timeouts. ARGV: owner, wait (ms).
pub const REDISSON_FAIR_GIVE_UP: &str = r"
local behind = false
for _, owner in ipairs(redis.call('lrange', KEYS[1], 0, -1)) do
    if behind then
        redis.call('zincrby', KEYS[2], -tonumber(ARGV[2]), owner)
    elseif owner == ARGV[1] then
        behind = true
    end
end
redis.call('lrem', KEYS[1], 0, ARGV[1])
redis.call('zrem', KEYS[2], ARGV[1])
";

/// The queue's owners, oldest first.
pub async fn queued(conn: &mut redis::aio::MultiplexedConnection, name: &str) -> Vec<String> {
    redis::cmd("LRANGE")
        .arg(queue(name))
        .arg(0)
        .arg(-1)
        .query_async(conn)
        .await
        .unwrap()
}
