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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use distlock::Connection;
use tokio::sync::{mpsc, oneshot, Semaphore};

use super::{Reservation, ReserveError, Sale};
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
    reply: Reply,
}

/// The per-coupon queues. Each coupon's queue is drained by its own task, which ends when
/// the batcher is dropped.
#[derive(Default)]
pub(super) struct Batcher {
    queues: Mutex<HashMap<i64, mpsc::UnboundedSender<Pending>>>,
}

impl Batcher {
    pub(super) async fn reserve(
        &self,
        conn: &Connection,
        sale: &Sale,
    ) -> Result<Reservation, ReserveError> {
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            user_id: sale.user_id,
            order_id: sale.order_id.clone(),
            reply,
        };
        self.queue(conn, sale.coupon_id, &sale.keys)
            .send(pending)
            .map_err(|_| closed())?;
        // The reservation runs whether or not this request is still waiting: a purchase
        // whose caller went away is a sale all the same, as with a lost reply.
        answer.await.map_err(|_| closed())?
    }

    fn queue(
        &self,
        conn: &Connection,
        coupon_id: i64,
        keys: &CouponKeys,
    ) -> mpsc::UnboundedSender<Pending> {
        let mut queues = self.queues.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(queue) = queues.get(&coupon_id).filter(|queue| !queue.is_closed()) {
            return queue.clone();
        }
        let (sender, receiver) = mpsc::unbounded_channel();
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
    mut queue: mpsc::UnboundedReceiver<Pending>,
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
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let (mut conn, keys) = (conn.clone(), keys.clone());
        tokio::spawn(async move {
            let outcome = invoke(&mut conn, &keys, coupon_id, &batch).await;
            for (index, pending) in batch.into_iter().enumerate() {
                let answer = match &outcome {
                    Ok(codes) => decode(codes.get(index).copied(), pending.order_id),
                    Err(err) => Err(ReserveError::Redis(err.clone())),
                };
                // The caller may have gone away; the outcome stands regardless.
                let _ = pending.reply.send(answer);
            }
            drop(permit);
        });
    }
}

async fn invoke(
    conn: &mut Connection,
    keys: &CouponKeys,
    coupon_id: i64,
    batch: &[Pending],
) -> redis::RedisResult<Vec<i64>> {
    let mut invocation = RESERVE.key(&keys.stock);
    invocation
        .key(&keys.buyers)
        .key(&keys.orders)
        .arg(coupon_id)
        .arg(now_millis());
    for pending in batch {
        invocation.arg(pending.user_id).arg(&pending.order_id);
    }
    invocation.invoke_async(conn).await
}

fn decode(code: Option<i64>, order_id: String) -> Result<Reservation, ReserveError> {
    match code {
        Some(1) => Ok(Reservation::Reserved { order_id }),
        Some(0) => Ok(Reservation::SoldOut),
        Some(-1) => Ok(Reservation::AlreadyPurchased),
        Some(-2) => Ok(Reservation::NotLoaded),
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
