//! Segmented locks for a hot item: the stock is split into K segments, each a field of the
//! stock hash with its own distlock lock, so K purchases can proceed at once instead of
//! one.
//!
//! One-per-user cannot be checked per segment, since two requests of one user may land on
//! different segments. The buyer's entry is therefore claimed first (`claim.lua`, an
//! HSETNX of `~SETTLE_BY:INSTANCE:ORDER`), whose reply is atomic: only one request of a
//! user gets it. The sale replaces the claim with the order id; a claim that finds every
//! segment empty or busy is withdrawn; a claim left by a crash is removed once its
//! settle-by time has passed (`crate::reconcile`).

use std::collections::HashMap;

use super::{already_purchased, segment_stock, unclaim, Reservation, ReserveError, Reserver, Sale};
use crate::keys::CouponKeys;
use crate::scripts::CLAIM;

pub(super) async fn reserve(reserver: &Reserver, sale: &Sale) -> Result<Reservation, ReserveError> {
    let mut conn = reserver.locks.connection();
    let settings = &reserver.settings;
    let segments = settings.stock_segments();
    // One round trip tells the common answers apart before anything is claimed or locked:
    // not loaded, already a buyer, or every segment empty (which never changes back).
    let (shares, held): (HashMap<u32, i64>, Option<String>) = redis::pipe()
        .hgetall(&sale.keys.stock)
        .hget(&sale.keys.buyers, sale.user_id)
        .query_async(&mut conn)
        .await?;
    if shares.is_empty() {
        return Ok(Reservation::NotLoaded);
    }
    if let Some(held) = held {
        return Ok(already_purchased(held));
    }
    if shares.values().all(|&left| left <= 0) {
        return Ok(Reservation::SoldOut);
    }
    let claimed: redis::Value = CLAIM
        .key(&sale.keys.buyers)
        .key(&sale.keys.claims)
        .arg(sale.user_id)
        .arg(sale.claim())
        .arg(sale.settle_by_ms)
        .invoke_async(&mut conn)
        .await?;
    match claimed {
        redis::Value::Int(1) => {}
        redis::Value::BulkString(held) => {
            return Ok(already_purchased(
                String::from_utf8_lossy(&held).into_owned(),
            ))
        }
        // The entry vanished between HSETNX and HGET (withdrawn): another request's.
        _ => return Ok(Reservation::AlreadyPurchased { order_id: None }),
    }
    // From here until the outcome is decided, an abandoned purchase (its client gone, or
    // cut at the shutdown deadline: its future dropped) withdraws its claim on the way out.
    let abandoned = WithdrawOnDrop::new(sale, conn.clone());
    let outcome = take_from_some_segment(reserver, sale, segments, &shares).await;
    if matches!(
        outcome,
        Ok(Reservation::SoldOut | Reservation::Busy | Reservation::Expired)
            | Err(ReserveError::Redis(_) | ReserveError::Lock(_) | ReserveError::NotAuthority)
    ) {
        // Nothing was sold: withdraw the claim, so a user who was turned away may come
        // back. Not after a lost write reply: resolving it decides the claim.
        sale.unclaim(&mut conn).await;
    }
    abandoned.disarm();
    outcome
}

/// Withdraws a purchase's claim if dropped while armed: a purchase abandoned mid-way
/// (hyper drops a handler's future when its client disconnects) would otherwise leave the
/// claim until the repair pass, and the user refused meanwhile. The withdrawal is
/// conditional, so one that races the sale's write does no harm.
struct WithdrawOnDrop {
    claim: Option<(CouponKeys, i64, String, distlock::Connection)>,
}

impl WithdrawOnDrop {
    fn new(sale: &Sale, conn: distlock::Connection) -> Self {
        WithdrawOnDrop {
            claim: Some((sale.keys.clone(), sale.user_id, sale.claim(), conn)),
        }
    }

    /// The outcome is decided: nothing to do on drop.
    fn disarm(mut self) {
        self.claim = None;
    }
}

impl Drop for WithdrawOnDrop {
    fn drop(&mut self) {
        let Some((keys, user_id, claim, mut conn)) = self.claim.take() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { unclaim(&mut conn, &keys, user_id, &claim).await });
        }
    }
}

/// Takes stock from a segment, starting at the user's own: first every segment without
/// waiting (`try_lock`), so a free one sells at once; then the busy ones in turn. The whole
/// wait is bounded by `lock_wait`, however many segments there are: each busy segment gets
/// an equal share of what is left of it, so one stuck segment (a stalled holder) costs a
/// fraction of the wait, not all of it. `shares` is the stock seen before the claim; a
/// segment empty then is empty for good.
///
/// Waiting on every segment at once for whichever frees first was tried: under a rush it
/// multiplies lock traffic by the number of segments, and the bench's segmented rate fell
/// from 0.20 to 0.06 of lua's.
async fn take_from_some_segment(
    reserver: &Reserver,
    sale: &Sale,
    segments: u32,
    shares: &HashMap<u32, i64>,
) -> Result<Reservation, ReserveError> {
    let (locks, settings) = (&reserver.locks, &reserver.settings);
    let give_up = (tokio::time::Instant::now() + settings.lock_wait).min(sale.deadline);
    let home = u32::try_from(sale.user_id.rem_euclid(i64::from(segments))).unwrap_or(0);
    let candidates: Vec<u32> = (0..segments)
        .map(|step| (home + step) % segments)
        .filter(|segment| shares.get(segment).is_some_and(|&left| left > 0))
        .collect();
    // First every segment without waiting: a free one sells at once, whichever it is.
    let mut waiting_for = Vec::with_capacity(candidates.len());
    for &segment in &candidates {
        let lock = locks
            .lock(sale.keys.segment_lock(segment))?
            .with_lease(settings.lock_lease);
        match lock.try_lock().await? {
            Some(guard) => {
                if let Some(decided) = sell_in(reserver, sale, segment, guard).await? {
                    return Ok(decided);
                }
            }
            None => waiting_for.push((segment, lock)),
        }
    }
    // Then wait on the busy ones in turn, each for an equal share of what is left of the
    // wait, so the total stays within lock_wait however many there are.
    let mut busy = false;
    let count = waiting_for.len();
    for (tried, (segment, lock)) in waiting_for.into_iter().enumerate() {
        let left = give_up.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Ok(Reservation::Busy);
        }
        let still_to_try = u32::try_from(count - tried).unwrap_or(u32::MAX);
        let waiting = tokio::time::Instant::now();
        let acquired = lock.try_lock_for(left / still_to_try).await;
        reserver
            .metrics
            .lock_wait_seconds
            .observe(waiting.elapsed().as_secs_f64());
        let Some(guard) = acquired? else {
            busy = true;
            continue;
        };
        match sell_in(reserver, sale, segment, guard).await? {
            Some(decided) => return Ok(decided),
            None => continue,
        }
    }
    Ok(if busy {
        Reservation::Busy
    } else {
        Reservation::SoldOut
    })
}

/// Sells one unit from `segment` under its lock, if the segment still has stock. Returns
/// the decided outcome, or `None` when the segment is empty and another may be tried.
async fn sell_in(
    reserver: &Reserver,
    sale: &Sale,
    segment: u32,
    guard: distlock::LockGuard,
) -> Result<Option<Reservation>, ReserveError> {
    let mut conn = reserver.locks.connection();
    let outcome = match segment_stock(&mut conn, &sale.keys, segment).await {
        Ok(Some(left)) if left > 0 => {
            reserver.settings.fault_point(sale);
            // Guarded: the unit seen above may be gone if this holder paused past its lease.
            match sale.record(&mut conn, segment, true).await {
                Ok(Reservation::SoldOut) => Ok(None),
                other => other.map(Some),
            }
        }
        Ok(_) => Ok(None),
        Err(err) => Err(err.into()),
    };
    // The outcome is decided; a failed release (an expired lease) does not change it.
    if let Err(err) = guard.release().await {
        tracing::warn!(error = %err, "releasing a segment lock failed after the sale was decided");
    }
    outcome
}
