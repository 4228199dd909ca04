//! The default: one Lua script checks and writes atomically, with no lock. Redis runs a
//! script to completion before any other command, so no purchase can see the stock between
//! another's check and its decrement.
//!
//! Concurrent purchases of one coupon are merged: while a script call is in flight, the
//! requests that arrive queue up, and the next call carries all of them (up to
//! [`MAX_BATCH`]). Under light load every batch holds one purchase and nothing waits; under
//! a rush, one script call and one round trip serve dozens of buyers, which is what keeps
//! Redis from becoming the bottleneck of a hot coupon. Up to [`IN_FLIGHT`] calls per coupon
//! run at once, so the connection stays pipelined.
//!
//! The queue is bounded ([`StrategySettings::queue_limit`]): past it a purchase is turned
//! away at once, before anything is sold. A queued purchase whose caller has gone, or
//! whose deadline passed, is dropped when its batch is formed, so it is never sold.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use distlock::Connection;
use redis::Value;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::time::Instant;

use super::{already_purchased, fence_from_now, Reservation, ReserveError, Sale, StrategySettings};
use crate::keys::CouponKeys;
use crate::model::now_millis;
use crate::scripts::RESERVE;

/// Most purchases in one script call; bounds how long one call holds Redis.
pub const MAX_BATCH: usize = 128;
/// Script calls of one coupon in flight at once.
pub const IN_FLIGHT: usize = 4;

type Reply = oneshot::Sender<Result<Reservation, ReserveError>>;

struct Pending {
    user_id: i64,
    order_id: String,
    deadline: Instant,
    /// Whether this instance may still sell when the batch is formed: a purchase queued
    /// while the process was frozen past a take-over must not be sold when it wakes.
    tenure: Arc<crate::authority::Tenure>,
    reply: Reply,
}

/// The per-coupon queues. Each coupon's queue is drained by its own task, which ends when
/// the batcher is dropped.
#[derive(Default)]
pub(super) struct Batcher {
    queues: Mutex<HashMap<i64, mpsc::Sender<Pending>>>,
}

impl Batcher {
    pub(super) async fn reserve(
        &self,
        conn: &Connection,
        sale: &Sale,
        settings: &StrategySettings,
    ) -> Result<Reservation, ReserveError> {
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            user_id: sale.user_id,
            order_id: sale.order_id.clone(),
            deadline: sale.deadline,
            tenure: sale.tenure.clone(),
            reply,
        };
        match self
            .queue(conn, sale.coupon_id, &sale.keys, settings.queue_limit)
            .try_send(pending)
        {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => return Ok(Reservation::Overloaded),
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(closed()),
        }
        // If this request goes away (its client disconnected), `answer` is dropped, and a
        // purchase still queued is dropped with it instead of sold.
        answer.await.map_err(|_| closed())?
    }

    fn queue(
        &self,
        conn: &Connection,
        coupon_id: i64,
        keys: &CouponKeys,
        limit: usize,
    ) -> mpsc::Sender<Pending> {
        let mut queues = self.queues.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(queue) = queues.get(&coupon_id).filter(|queue| !queue.is_closed()) {
            return queue.clone();
        }
        let (sender, receiver) = mpsc::channel(limit.max(1));
        tokio::spawn(drain(conn.clone(), coupon_id, keys.clone(), receiver));
        queues.insert(coupon_id, sender.clone());
        sender
    }
}

/// Takes whatever has queued up, up to [`MAX_BATCH`], and reserves it in one script call.
async fn drain(
    conn: Connection,
    coupon_id: i64,
    keys: CouponKeys,
    mut queue: mpsc::Receiver<Pending>,
) {
    let in_flight = Arc::new(Semaphore::new(IN_FLIGHT));
    let keys = Arc::new(keys);
    loop {
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let Some(first) = queue.recv().await else {
            return;
        };
        let mut batch = Vec::new();
        let mut next = Some(first);
        while let Some(pending) = next {
            admit(pending, &mut batch);
            next = if batch.len() < MAX_BATCH {
                queue.try_recv().ok()
            } else {
                None
            };
        }
        if batch.is_empty() {
            continue;
        }
        let (mut conn, keys) = (conn.clone(), keys.clone());
        tokio::spawn(async move {
            let fence_ms = fence_from_now();
            let outcome = invoke(&mut conn, &keys, coupon_id, fence_ms, &batch).await;
            for (index, pending) in batch.into_iter().enumerate() {
                let answer = match &outcome {
                    Ok(codes) => decode(codes.get(index), pending.order_id),
                    Err(err) => Err(ReserveError::after_send(fence_ms, err.clone())),
                };
                // The caller may have gone away; the outcome stands regardless.
                let _ = pending.reply.send(answer);
            }
            drop(permit);
        });
    }
}

/// Adds `pending` to the batch unless it must not be sold: its caller is gone (nobody
/// would be told), or its deadline passed while it queued (told so now).
fn admit(pending: Pending, batch: &mut Vec<Pending>) {
    if pending.reply.is_closed() {
        return;
    }
    if Instant::now() >= pending.deadline {
        let _ = pending.reply.send(Ok(Reservation::Expired));
        return;
    }
    if !pending.tenure.may_sell() {
        let _ = pending.reply.send(Err(ReserveError::NotAuthority));
        return;
    }
    batch.push(pending);
}

async fn invoke(
    conn: &mut Connection,
    keys: &CouponKeys,
    coupon_id: i64,
    fence_ms: i64,
    batch: &[Pending],
) -> redis::RedisResult<Vec<Value>> {
    let mut invocation = RESERVE.key(&keys.stock);
    invocation
        .key(&keys.buyers)
        .key(&keys.orders)
        .arg(coupon_id)
        .arg(now_millis())
        .arg(fence_ms);
    for pending in batch {
        invocation.arg(pending.user_id).arg(&pending.order_id);
    }
    invocation.invoke_async(conn).await
}

fn decode(code: Option<&Value>, order_id: String) -> Result<Reservation, ReserveError> {
    match code {
        Some(Value::Int(1)) => Ok(Reservation::Reserved { order_id }),
        Some(Value::Int(0)) => Ok(Reservation::SoldOut),
        Some(Value::Int(-2)) => Ok(Reservation::NotLoaded),
        Some(Value::Int(-3)) => Ok(Reservation::Expired),
        Some(Value::BulkString(held)) => Ok(already_purchased(
            String::from_utf8_lossy(held).into_owned(),
        )),
        other => Err(ReserveError::Redis(redis::RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "reserve.lua returned an unknown code",
            format!("{other:?}"),
        )))),
    }
}

fn closed() -> ReserveError {
    ReserveError::Redis(redis::RedisError::from((
        redis::ErrorKind::Io,
        "the reservation batcher stopped",
    )))
}
